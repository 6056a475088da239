"""Unmodified e2b-code-interpreter calls against airlock's `code-interpreter-v1` template: E2B's
code-interpreter API over real Jupyter kernels (IPython for python, bash_kernel for bash, IRkernel
for R, Deno's for JavaScript and TypeScript, airlock's JShell kernel for Java).

Newer e2b-code-interpreter versions send `/execute` to E2B_SANDBOX_URL with
`E2b-Sandbox-Id`/`E2b-Sandbox-Port: 49999` headers. Older ones (2.6.2 among them) only know
`https://49999-<id>.<domain>`, so with them these tests take the E2B_DOMAIN route; their
`E2B_DEBUG=true` route to localhost:49999 (airlock's `--e2b-debug-listen`) has its own test."""
import base64
import contextlib
import inspect
import os
import time

import pytest

from conftest import delete_sandbox, domain_env, skip_unless_sdk_has


def header_routed():
    from e2b_code_interpreter import Sandbox

    return "get_sandbox_url" in inspect.getsource(Sandbox)


def _interpreter(timeout):
    from e2b_code_interpreter import Sandbox

    # The sandbox keeps the connection settings it was created with.
    with contextlib.nullcontext() if header_routed() else domain_env():
        return Sandbox.create(timeout=timeout, envs={"AIRLOCK_SANDBOX_ENV": "from create"})


@pytest.fixture(scope="module")
def ci(airlock_server):
    s = _interpreter(900)
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
    assert ci.run_code("'still alive'").text == "still alive"


def test_a_cell_right_after_an_error_runs(ci):
    """A failed cell aborts nothing after it: the next cell, sent at once, runs, every time (the
    interrupt test below is where ipykernel's abort after an error was seen)."""
    ctx = ci.create_code_context()
    try:
        for i in range(15):
            assert ci.run_code("raise ValueError('x')", context=ctx).error.name == "ValueError"
            ex = ci.run_code(str(i), context=ctx)
            assert ex.error is None, (i, ex.error)
            assert ex.text == str(i)
    finally:
        ci.remove_code_context(ctx)


def test_text_is_the_plain_text_without_its_quotes(ci):
    # E2B's server shows a string result's repr without the surrounding quotes.
    assert ci.run_code("'bar'").text == "bar"
    assert ci.run_code('"it\'s"').text == "it's"
    assert ci.run_code("[1, 'a']").text == "[1, 'a']"


def test_indented_code_runs(ci):
    ex = ci.run_code("\n    x = 1\n    x\n")
    assert ex.error is None, ex.error
    assert ex.text == "1"


def test_ipython_shell_escapes(ci):
    ex = ci.run_code("!pwd")
    assert ex.error is None, ex.error
    assert "".join(ex.logs.stdout).strip() == "/home/user"
    assert ci.run_code("%cd /tmp\nimport os\nos.getcwd()").text == "/tmp"
    ci.run_code("%cd /home/user")


def test_execution_count_counts_cells(ci):
    first = ci.run_code("1").execution_count
    assert isinstance(first, int) and first > 0
    assert ci.run_code("2").execution_count == first + 1


def test_env_vars_last_one_execution(ci):
    ex = ci.run_code("import os; os.getenv('AIRLOCK_FOO')", envs={"AIRLOCK_FOO": "bar 'baz'"})
    assert ex.text == "bar 'baz'"
    assert ci.run_code("import os; os.getenv('AIRLOCK_FOO', 'default')").text == "default"


def test_the_sandbox_envs_reach_every_execution_under_its_own(ci):
    """As E2B's interpreter does: the envs the sandbox was created with apply to each execution
    (python and bash), and an execution's own envs win for that execution."""
    read = "import os; os.getenv('AIRLOCK_SANDBOX_ENV')"
    assert ci.run_code(read).text == "from create"
    assert ci.run_code(read, envs={"AIRLOCK_SANDBOX_ENV": "mine"}).text == "mine"
    assert ci.run_code(read).text == "from create"
    bash = ci.run_code("echo $AIRLOCK_SANDBOX_ENV", language="bash")
    assert "".join(bash.logs.stdout).strip() == "from create"


def test_stdout_and_stderr_callbacks(ci):
    out, err = [], []
    ex = ci.run_code(
        "import sys\nfor i in range(3): print(i)\nprint('oops', file=sys.stderr)",
        on_stdout=lambda m: out.append(m.line),
        on_stderr=lambda m: err.append(m.line),
    )
    # The kernel streams what a cell writes in batches, as Jupyter does: lines written together
    # may come as one message.
    assert "".join(out) == "0\n1\n2\n" and err == ["oops\n"]
    assert ex.logs.stderr == ["oops\n"]


def test_matplotlib_png_and_chart(ci):
    ex = ci.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.title('t')\nplt.show()", timeout=300
    )
    assert ex.error is None, ex.error
    pngs = [r.png for r in ex.results if r.png]
    assert len(pngs) == 1
    assert base64.b64decode(pngs[0]).startswith(b"\x89PNG\r\n\x1a\n")
    # The figure is display data (not the cell's value), with E2B's chart read out of it.
    (fig,) = [r for r in ex.results if r.png]
    assert fig.is_main_result is False and fig.text.startswith("<Figure size")
    chart = fig.chart
    assert chart is not None and getattr(chart.type, "value", chart.type) == "line" and chart.title == "t"
    assert [list(map(float, p)) for p in chart.elements[0].points] == [[1, 3], [2, 1], [3, 2]]


def test_a_figure_of_several_charts_is_a_superchart(ci):
    """E2B's superchart test: one figure, a line and a scatter, each read out as its own chart."""
    ex = ci.run_code(
        "import matplotlib.pyplot as plt\nimport numpy as np\n"
        "fig, axs = plt.subplots(1, 2, figsize=(10, 8))\nfig.suptitle('Multiple Charts Example', fontsize=16)\n"
        "x1 = np.linspace(0, 10, 100)\naxs[0].plot(x1, np.sin(x1), 'r')\naxs[0].set_title('Sine Wave')\n"
        "axs[0].grid(True)\naxs[1].scatter(np.random.rand(5), np.random.rand(5), c='blue', label='Dataset 1')\n"
        "axs[1].set_xlabel('X')\naxs[1].set_ylabel('Y')\naxs[1].set_title('Scatter Plot')\naxs[1].grid(True)\n"
        "plt.show()", timeout=300)
    assert ex.error is None, ex.error
    chart = ex.results[0].chart
    assert chart is not None, ex.results
    from e2b_code_interpreter.charts import LineChart, ScatterChart, SuperChart

    assert isinstance(chart, SuperChart) and chart.title == "Multiple Charts Example"
    line, scatter = chart.elements
    assert isinstance(line, LineChart) and line.title == "Sine Wave" and len(line.elements[0].points) == 100
    assert isinstance(scatter, ScatterChart) and (scatter.x_label, scatter.y_label) == ("X", "Y")
    assert len(scatter.elements) == 1 and len(scatter.elements[0].points) == 5


def test_dataframe_gives_data(ci):
    ex = ci.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2, 3], 'b': ['x', 'y', 'z']})", timeout=300)
    assert ex.error is None, ex.error
    (r,) = ex.results
    assert r.is_main_result and r.data == {"a": [1, 2, 3], "b": ["x", "y", "z"]}
    assert "<table" in r.html and "a  b" in r.text


def test_display_data_and_mime_types(ci):
    ex = ci.run_code(
        "from IPython.display import display, HTML, Markdown, Latex\n"
        "display(HTML('<b>h</b>'))\ndisplay(Markdown('**m**'))\ndisplay(Latex('$x$'))\n{'k': [1, 2]}"
    )
    assert ex.error is None, ex.error
    shown = [r for r in ex.results if not r.is_main_result]
    assert [(r.html, r.markdown, r.latex) for r in shown] == [
        ("<b>h</b>", None, None), (None, "**m**", None), (None, None, "$x$")]
    (main,) = [r for r in ex.results if r.is_main_result]
    assert main.json == {"k": [1, 2]} and main.text == "{'k': [1, 2]}"


def test_a_cell_past_the_client_timeout_is_interrupted(ci):
    """The SDK's timeout closes the connection; the server interrupts the cell, so the context's
    next cell runs instead of waiting behind it (the cell would never end by itself)."""
    from e2b import TimeoutException

    # Over HTTP/1.1 (E2B_SANDBOX_URL) the closed connection reaches the sandbox at once. Over
    # E2B_DOMAIN the SDK speaks HTTP/2 and its timeout only drops the stream (httpcore sends no
    # RST_STREAM) while the connection stays in its pool: nothing tells the server the client
    # left until that connection goes, which the server must not hasten (a pooled connection
    # closed under the SDK fails its next request; see crates/server/src/listen.rs).
    if not header_routed():
        pytest.skip("this SDK reaches the interpreter over HTTP/2 (E2B_DOMAIN), where a client's timeout sends nothing the server sees")
    limit = 30
    ctx = ci.create_code_context()
    try:
        ci.run_code("n = 0", context=ctx)
        with pytest.raises(TimeoutException):
            ci.run_code("import time\nwhile True:\n    n += 1\n    time.sleep(0.05)", context=ctx, timeout=5)
        started = time.time()
        ex = ci.run_code("n > 0", context=ctx, timeout=limit)
        assert ex.error is None, ex.error
        assert ex.text == "True", "the interrupted cell did not run at all"
        assert time.time() - started < limit
        # Interrupted for good: the counter stopped.
        before = ci.run_code("n", context=ctx).text
        time.sleep(1)
        assert ci.run_code("n", context=ctx).text == before
    finally:
        ci.remove_code_context(ctx)


def test_bash_language(ci):
    ex = ci.run_code("pwd", language="bash")
    assert ex.error is None, ex.error
    assert ex.logs.stdout == ["/home/user\n"]
    assert ci.run_code("AIRLOCK_X=5", language="bash").error is None
    assert ci.run_code("echo $((AIRLOCK_X * 2))", language="bash").logs.stdout == ["10\n"]
    assert ci.run_code("echo $AIRLOCK_E", language="bash", envs={"AIRLOCK_E": "a b"}).logs.stdout == ["a b\n"]
    assert ci.run_code("echo ${AIRLOCK_E-unset}", language="bash").logs.stdout == ["unset\n"]
    # bash_kernel's error, as E2B's (the same kernel): the exit status; the message is in the
    # output (bash runs on a terminal, where stderr is stdout).
    ex = ci.run_code("ls /no/such/dir", language="bash")
    assert ex.error is not None and ex.error.value == "2", ex
    assert "No such file or directory" in "".join(ex.logs.stdout + ex.logs.stderr), ex.logs
    if header_routed():
        from e2b import TimeoutException

        with pytest.raises(TimeoutException):
            ci.run_code("sleep 600", language="bash", timeout=5)
        assert ci.run_code("echo $AIRLOCK_X", language="bash", timeout=30).logs.stdout == ["5\n"]


@pytest.fixture
def ci_alone(airlock_server):
    """A code interpreter sandbox of a test's own, for a language's kernel (R's ~100 MiB, a JVM,
    Deno) beside none of the shared sandbox's."""
    s = _interpreter(600)
    yield s
    delete_sandbox(airlock_server, s.sandbox_id)


def test_r_language(ci_alone):
    """R on Debian's IRkernel: output as R prints it, envs for one execution (E2B's env_vars
    tests for R), state across cells, an error with its message, an interrupt."""
    ci = ci_alone
    ex = ci.run_code('print("x")', language="r", timeout=300)
    assert ex.error is None, ex.error
    assert ex.logs.stdout == ['[1] "x"\n']
    ex = ci.run_code('Sys.getenv("FOO")', envs={"FOO": "bar"}, language="r")
    assert ex.results[0].text.strip() == '[1] "bar"'
    ex = ci.run_code('Sys.getenv("FOO", unset = "default")', language="r")
    assert ex.results[0].text.strip() == '[1] "default"'
    assert ci.run_code('Sys.getenv("AIRLOCK_SANDBOX_ENV")', language="r").results[0].text.strip() == '[1] "from create"'
    assert ci.run_code("y <- 21", language="r").error is None
    assert ci.run_code("y * 2", language="r").results[0].text.strip() == "[1] 42"
    ex = ci.run_code('stop("no such thing")', language="r")
    assert ex.error is not None and "no such thing" in ex.error.value, ex.error
    if header_routed():
        from e2b import TimeoutException

        with pytest.raises(TimeoutException):
            ci.run_code("while (TRUE) Sys.sleep(0.05)", language="r", timeout=5)
        assert ci.run_code("y + 1", language="r", timeout=30).results[0].text.strip() == "[1] 22"


def test_javascript_and_typescript(ci_alone):
    """Deno's kernel, as E2B's own default-kernel tests use it: console.log is stdout, ESM
    imports, top-level await's value is the result, TypeScript, envs for one execution, every
    cell's own output, an error with its traceback, an interrupt; and the default javascript
    context is listed."""
    ci = ci_alone
    ex = ci.run_code("console.log('Hello, World!')", language="js", timeout=300)
    assert ex.error is None, ex.error
    assert ex.logs.stdout == ["Hello, World!\n"]
    ex = ci.run_code("import { readFileSync } from 'fs'\nconsole.log(typeof readFileSync)", language="js")
    assert ex.logs.stdout == ["function\n"], ex
    assert ci.run_code("await Promise.resolve('Hello World!')", language="js").text == "Hello World!"
    ex = ci.run_code("const message: string = 'Hello, World!'; console.log(message)", language="ts")
    assert ex.error is None and ex.logs.stdout == ["Hello, World!\n"], ex
    assert ci.run_code("process.env.FOO", language="js", envs={"FOO": "bar"}).text == "bar"
    assert ci.run_code("process.env.FOO ?? 'unset'", language="js").text == "unset"
    assert ci.run_code("process.env.AIRLOCK_SANDBOX_ENV", language="js").text == "from create"
    assert ci.run_code("let y = 21", language="js").error is None
    assert ci.run_code("y * 2", language="js").text == "42"
    # Deno publishes a cell's output from a queue, sometimes after the cell's idle status
    # (~1 cell in 40 under TCG lost its result or stdout before the flush): each cell has both.
    for i in range(40):
        ex = ci.run_code(f"console.log('out {i}'); 'result {i}'", language="js")
        assert (ex.logs.stdout, ex.text) == ([f"out {i}\n"], f"result {i}"), (i, ex)
    ex = ci.run_code("function f() { throw new Error('no such thing') }\nf()", language="js")
    assert ex.error is not None and (ex.error.name, ex.error.value) == ("Error", "no such thing"), ex.error
    assert "at f" in ex.error.traceback, ex.error.traceback
    if header_routed():
        from e2b import TimeoutException

        # Deno's kernel ends on the interrupt's SIGINT (V8 cannot stop a running loop from
        # outside): the context starts again, empty, and the next cell runs.
        with pytest.raises(TimeoutException):
            ci.run_code("while (true) {}", language="js", timeout=5)
        assert ci.run_code("typeof y", language="js", timeout=120).text == "undefined"
    languages = [c.language for c in ci.list_code_contexts()]
    assert "python" in languages and "javascript" in languages, languages


def test_java_language(ci_alone):
    """airlock's Java kernel (JShell in one JVM): println streams its text and its newline
    apart (E2B's test reads stdout[0]), the last expression is the result, envs for one
    execution as system properties (as E2B's), an exception with its trace, a compile error,
    an interrupt that keeps the state."""
    ci = ci_alone
    ex = ci.run_code('System.out.println("Hello, World!")', language="java", timeout=300)
    assert ex.error is None, ex.error
    assert ex.logs.stdout[0] == "Hello, World!" and "".join(ex.logs.stdout) == "Hello, World!\n"
    assert ci.run_code("int y = 21;", language="java").error is None
    assert ci.run_code("y * 2", language="java").text == "42"
    ex = ci.run_code('System.getProperty("FOO")', language="java", envs={"FOO": "bar"})
    assert ex.text == "bar", ex
    assert ci.run_code('System.getProperty("FOO", "unset")', language="java").text == "unset"
    assert ci.run_code('System.getenv("AIRLOCK_SANDBOX_ENV")', language="java").text == "from create"
    ex = ci.run_code('void f() { throw new IllegalStateException("no such thing"); }\nf();', language="java")
    assert ex.error is not None, ex
    assert (ex.error.name, ex.error.value) == ("java.lang.IllegalStateException", "no such thing"), ex.error
    assert ".f(#" in ex.error.traceback, ex.error.traceback  # JShell names a frame by its snippet
    ex = ci.run_code('int z = "text";', language="java")
    assert ex.error is not None and ex.error.name == "CompilationException", ex
    assert "incompatible types" in ex.error.value, ex.error
    if header_routed():
        from e2b import TimeoutException

        with pytest.raises(TimeoutException):
            ci.run_code("while (true) { Thread.sleep(50); }", language="java", timeout=5)
        assert ci.run_code("y + 1", language="java", timeout=30).text == "22"


def test_a_context_may_start_anywhere(ci):
    """E2B's kernels run as root: a context with options, in /root, is listed last as made."""
    skip_unless_sdk_has(hasattr(ci, "list_code_contexts"), "Sandbox.list_code_contexts")
    ctx = ci.create_code_context(language="python", cwd="/root")
    try:
        last = ci.list_code_contexts()[-1]
        assert (last.id, last.language, last.cwd) == (ctx.id, "python", "/root")
        assert ci.run_code("import os; os.getcwd()", context=ctx).text == "/root"
    finally:
        ci.remove_code_context(ctx)


def test_bash_context_with_cwd(ci):
    skip_unless_sdk_has(hasattr(ci, "list_code_contexts"), "Sandbox.list_code_contexts")
    ctx = ci.create_code_context(language="bash", cwd="/tmp")
    try:
        assert (ctx.language, ctx.cwd) == ("bash", "/tmp")
        assert ci.run_code("pwd", context=ctx).logs.stdout == ["/tmp\n"]
        listed = {c.id: (c.language, c.cwd) for c in ci.list_code_contexts()}
        assert listed[ctx.id] == ("bash", "/tmp")
        assert ("python", "/home/user") in listed.values()
    finally:
        ci.remove_code_context(ctx)


def test_unknown_language_is_refused_by_name(ci):
    from e2b import SandboxException

    with pytest.raises(SandboxException) as e:
        ci.run_code("1", language="cobol")
    assert "400" in str(e.value) and "cobol" in str(e.value)
    with pytest.raises(SandboxException) as e:
        ci.create_code_context(language="cobol")
    assert "400" in str(e.value) and "cobol" in str(e.value)


def test_restart_clears_a_context(ci):
    skip_unless_sdk_has(hasattr(ci, "restart_code_context"), "Sandbox.restart_code_context")
    ctx = ci.create_code_context()
    try:
        assert ci.run_code("z = 1", context=ctx).error is None
        ci.restart_code_context(ctx)
        ex = ci.run_code("z", context=ctx)
        assert ex.error is not None and ex.error.name == "NameError"
    finally:
        ci.remove_code_context(ctx)


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
