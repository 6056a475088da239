#!/usr/bin/env python3
"""airlock's code interpreter: the API of E2B's code-interpreter server (port 49999) over real
Jupyter kernels, one per context, driven with jupyter_client.

POST /execute streams NDJSON exactly as E2B's server does: stdout/stderr as the kernel streams
them, a `result` for every execute_result (`is_main_result`) and display_data with each MIME
type under E2B's key (`text` without surrounding quotes, `png`, `chart`, `data`, ... and the
rest in `extra`), `error` with name/value/traceback, `number_of_executions`, a `keepalive`
while a cell runs quietly, `end_of_execution`. A client that goes away (the SDK's timeout closes
the connection) gets its cell interrupted. /contexts creates, lists, restarts and deletes
contexts (a language and a working directory each).

The default Python kernel starts before the server listens: a sandbox restored from the
template's snapshot has it running. Such clones resume one process, so a kernel whose machine id
changed since it last drew random state reseeds before it runs the next cell.
"""
import argparse
import asyncio
import datetime
import json
import os
import shlex
import subprocess
import sys
import uuid

from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

HERE = os.path.dirname(os.path.abspath(__file__))
STARTUP = os.path.join(HERE, "ipython_startup.py")
# Where contexts start unless asked otherwise, as in E2B (whose kernels, like these, run as root).
HOME = "/home/user"
SANDBOX_ENV = "/run/airlock/env.json"
KEEPALIVE_S = 5
MAX_HEAD = 64 * 1024
MAX_BODY = 64 * 1024 * 1024
# Kernel (Jupyter kernelspec) behind each language E2B names; a language is offered when its
# kernelspec is installed.
KERNELS = {"python": "python3", "bash": "bash", "javascript": "javascript", "typescript": "javascript",
           "r": "ir", "java": "java"}
PYTHON_ARGS = [
    "--InteractiveShell.colors=NoColor",
    "--PlainTextFormatter.max_seq_length=0",
    f"--IPKernelApp.exec_files={STARTUP}",
]
# Deno's kernel hands a cell's output (console.log, its result) to a queue that another task
# publishes, under whichever request is current then: a line can come after the cell's idle
# status (seen: ~1 result in 40 under TCG). After each cell a silent flush puts this marker
# through the same queue; what comes before it is the cell's.
DENO_FLUSH_MIME = "application/x.airlock-flush"
DENO_FLUSH = f"await Deno.jupyter.broadcast('display_data', {{data: {{'{DENO_FLUSH_MIME}': ''}}, metadata: {{}}, transient: {{}}}}); undefined;"
DENO_FLUSH_S = 10
# MIME type -> the key E2B's Result gives it; whatever is left goes to `extra`.
MIME_KEYS = [
    ("text/html", "html"),
    ("text/markdown", "markdown"),
    ("image/svg+xml", "svg"),
    ("image/png", "png"),
    ("image/jpeg", "jpeg"),
    ("application/pdf", "pdf"),
    ("text/latex", "latex"),
    ("application/json", "json"),
    ("application/javascript", "javascript"),
    ("e2b/data", "data"),
    ("e2b/chart", "chart"),
]


def normalize_language(language):
    if not language:
        return "python"
    language = language.lower().strip()
    return {"js": "javascript", "ts": "typescript"}.get(language, language)


def sandbox_env():
    """The sandbox's environment variables, which airlock's agent keeps here (E2B's envd serves
    them on /envs): every kernel has them, under an execution's own `env_vars`."""
    try:
        with open(SANDBOX_ENV) as f:
            env = json.load(f)
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {}


def machine_id():
    try:
        with open("/etc/machine-id") as f:
            return f.read().strip()
    except OSError:
        return None


def iso(date):
    return date.isoformat() if isinstance(date, datetime.datetime) else date


def result_line(data, is_main):
    data = dict(data)
    out = {"type": "result"}
    text = data.pop("text/plain", None)
    if text and any(text.startswith(q) and text.endswith(q) for q in "'\""):
        text = text[1:-1]  # E2B shows `'bar'` as `bar`
    if text is not None:
        out["text"] = text
    for mime, key in MIME_KEYS:
        value = data.pop(mime, None)
        if value is not None:
            out[key] = value
    out["extra"] = data
    out["is_main_result"] = is_main
    return out


def error_line(name, value, traceback):
    return {"type": "error", "name": name, "value": value, "traceback": traceback}


class Unsupported(Exception):
    pass


class ClientGone(Exception):
    pass


class BadBody(Exception):
    pass


class Execution:
    """One execute_request in flight: its lines, and whether the kernel is done with it."""

    def __init__(self, background=False, late_for=None):
        self.background = background
        self.late_for = late_for  # a flush's: the cell whose late lines it passes on
        self.flushed = asyncio.Event()  # a flush's: its marker came through
        self.queue = asyncio.Queue()
        self.errored = False
        self.idle = False
        self.replied = False
        self.done = asyncio.Event()

    def put(self, line):
        if not self.background:
            self.queue.put_nowait(line)

    def finish_if_done(self):
        if self.idle and self.replied and not self.done.is_set():
            self.done.set()
            self.queue.put_nowait(None)


class Context:
    def __init__(self, language, cwd):
        self.id = str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        self.lock = asyncio.Lock()  # one cell at a time, as in E2B
        self.executions = {}
        self.km = None
        self.kc = None
        self.pumps = []
        self.seeded_for = None
        self.process_env = {}  # the kernel's environment at its start, without the sandbox's
        self.sandbox_env = {}  # the sandbox's environment, as the kernel has it now
        self.started_with = {}  # ... as the kernel had it at its start (and has after a restart)
        self.generation = 0  # bumped by every restart

    @property
    def base_env(self):
        """What an execution's own env_vars are restored to: the kernel's start environment under
        the sandbox's, as the kernel has them now."""
        return {**self.process_env, **self.sandbox_env}

    @property
    def deno(self):
        """Whether Deno's kernel runs this context's language (javascript, typescript)."""
        return KERNELS.get(self.language) == "javascript"

    def view(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    # --- the kernel -------------------------------------------------------------------------

    async def start(self):
        kernel_name = KERNELS.get(self.language)
        try:
            KernelSpecManager().get_kernel_spec(kernel_name or "")
        except NoSuchKernel:
            raise Unsupported(self.language) from None
        self.process_env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}  # the kernel picks inline
        self.sandbox_env = self.started_with = sandbox_env()
        self.km = AsyncKernelManager(kernel_name=kernel_name)
        await self.km.start_kernel(
            cwd=self.cwd,
            env=self.base_env,
            extra_arguments=PYTHON_ARGS if self.language == "python" else [],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.seeded_for = machine_id()
        await self.connect()

    async def connect(self):
        self.kc = self.km.client()
        self.kc.start_channels()
        await self.kc.wait_for_ready(timeout=300)
        self.pumps = [asyncio.ensure_future(self.pump_iopub()), asyncio.ensure_future(self.pump_shell())]

    async def disconnect(self):
        for task in self.pumps:
            task.cancel()
        self.pumps = []
        if self.kc is not None:
            self.kc.stop_channels()
        for ex in self.executions.values():
            ex.put(error_line("ContextRestarting", "Context was restarted", ""))
            ex.idle = ex.replied = True
            ex.finish_if_done()
        self.executions.clear()

    async def restart(self):
        self.generation += 1
        await self.disconnect()
        # A restarted kernel starts with the environment its first start had; the next
        # execution brings the sandbox's in again if it differs.
        self.sandbox_env = self.started_with
        await self.km.restart_kernel(now=True)
        self.seeded_for = machine_id()
        await self.connect()

    async def shutdown(self):
        await self.disconnect()
        try:
            await self.km.shutdown_kernel(now=True)
        except Exception:
            pass

    async def pump_iopub(self):
        while True:
            msg = await self.kc.get_iopub_msg()
            ex = self.executions.get(msg["parent_header"].get("msg_id"))
            if ex is None:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "display_data" and DENO_FLUSH_MIME in content.get("data", {}):
                ex.flushed.set()
                continue
            if kind in ("stream", "display_data", "execute_result") and ex.late_for is not None:
                ex = ex.late_for  # the flush's own error stays its own
            if kind == "stream" and content.get("name") in ("stdout", "stderr"):
                ex.put({"type": content["name"], "text": content["text"], "timestamp": iso(msg["header"].get("date"))})
            elif kind == "error":
                if not ex.errored:
                    ex.errored = True
                    ex.put(error_line(content["ename"], content["evalue"], "".join(content["traceback"])))
            elif kind == "display_data":
                ex.put(result_line(content["data"], False))
            elif kind == "execute_result":
                ex.put(result_line(content["data"], True))
            elif kind == "execute_input":
                ex.put({"type": "number_of_executions", "execution_count": content["execution_count"]})
            elif kind == "status" and content.get("execution_state") == "idle":
                ex.idle = True
                ex.finish_if_done()

    async def pump_shell(self):
        while True:
            msg = await self.kc.get_shell_msg()
            ex = self.executions.get(msg["parent_header"].get("msg_id"))
            if ex is None or msg["msg_type"] != "execute_reply":
                continue
            content = msg["content"]
            if content.get("status") == "error" and not ex.errored:
                ex.errored = True
                ex.put(error_line(content.get("ename", ""), content.get("evalue", ""), "".join(content.get("traceback", []))))
            elif content.get("status") == "aborted":
                ex.put(error_line("ExecutionAborted", "Execution was aborted", ""))
            ex.replied = True
            ex.finish_if_done()

    # --- cells ------------------------------------------------------------------------------

    def submit(self, code, background, late_for=None):
        # stop_on_error=False: a context runs one cell at a time, so there is never a queue worth
        # aborting, and with it on ipykernel aborts whatever arrives until a callback it schedules
        # after the failed cell's reply runs: the next cell, sent as soon as that reply came, was
        # sometimes answered "ExecutionAborted" (seen after an interrupted cell).
        msg_id = self.kc.execute(code, silent=background, store_history=not background,
                                 allow_stdin=False, stop_on_error=False)
        ex = Execution(background, late_for)
        self.executions[msg_id] = ex
        return msg_id, ex

    async def run_background(self, code):
        if not code:
            return
        msg_id, ex = self.submit(code, True)
        try:
            await self.wait_done(ex)
        finally:
            self.executions.pop(msg_id, None)

    async def wait_done(self, ex, limit=None):
        """Until the kernel is done with `ex`; restarts a kernel that died meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = None if limit is None else loop.time() + limit
        while not ex.done.is_set():
            if deadline is not None and loop.time() > deadline:
                return
            try:
                await asyncio.wait_for(ex.done.wait(), 1)
            except asyncio.TimeoutError:
                if not await self.km.is_alive():
                    await self.restart()

    def env_code(self, env_vars, restore):
        base = self.base_env
        if self.language == "python":
            if not restore:
                return f"__import__('os').environ.update({dict(env_vars)!r})"
            keep = {k: base[k] for k in env_vars if k in base}
            drop = [k for k in env_vars if k not in base]
            return f"(lambda e: ([e.pop(k, None) for k in {drop!r}], e.update({keep!r})))(__import__('os').environ)"
        if self.language == "bash":
            names = {k: v for k, v in env_vars.items() if k.replace("_", "a").isalnum() and not k[0].isdigit()}
            lines = self.env_lines(names, restore, lambda k, v: f"export {k}={shlex.quote(v)}", lambda k: f"unset {k}")
            return "\n".join(lines)
        # A JSON string is a string literal in JavaScript, Java and R.
        q = json.dumps
        if self.deno:
            lines = self.env_lines(env_vars, restore, lambda k, v: f"process.env[{q(k)}] = {q(v)};",
                                   lambda k: f"delete process.env[{q(k)}];")
            return "\n".join(lines + ["undefined;"]) if lines else ""
        if self.language == "java":
            # As E2B's Java kernel: a process cannot change its environment, so the values are
            # system properties (System.getProperty).
            lines = self.env_lines(env_vars, restore, lambda k, v: f"System.setProperty({q(k)}, {q(v)});",
                                   lambda k: f"System.clearProperty({q(k)});")
            return "\n".join(lines)
        if self.language == "r":
            # A quoted name is a valid argument name.
            lines = self.env_lines(env_vars, restore, lambda k, v: f"Sys.setenv({q(k)} = {q(v)})",
                                   lambda k: f"Sys.unsetenv({q(k)})")
            return "invisible({" + "; ".join(lines) + "})" if lines else ""
        return ""

    def env_lines(self, env_vars, restore, set_line, unset_line):
        """A line per variable: set to its value; or, restoring, back to the kernel's base
        environment, unset where that has none."""
        base = self.base_env
        return [unset_line(k) if restore and k not in base else set_line(k, base[k] if restore else str(v))
                for k, v in env_vars.items()]

    def reseed_code(self):
        if self.language == "python":
            return ("(lambda m: (m['random'].seed() if 'random' in m else None, "
                    "m['numpy'].random.seed() if 'numpy' in m else None))(__import__('sys').modules)")
        if self.language == "bash":
            return "RANDOM=$SRANDOM"
        if self.language == "r":
            return "set.seed(NULL)"  # as if never seeded: the next draw seeds from time and pid
        return ""

    async def execute(self, code, env_vars, emit, gone):
        """Run one cell, handing its lines to `emit`; `gone()` tells whether the client left."""
        async with self.lock:
            current = machine_id()
            setup = []
            if current != self.seeded_for:
                setup.append(self.reseed_code())
                self.seeded_for = current
            env = sandbox_env()
            if env != self.sandbox_env:
                # A new sandbox's identity (a restored clone) brought its environment: into the
                # kernel once, and what an execution's own env_vars are restored to.
                changed = {**self.sandbox_env, **env}
                self.sandbox_env = env
                setup.append(self.env_code(changed, restore=True))
            if any(setup):
                await self.run_background("\n".join(c for c in setup if c))
            if env_vars:
                await self.run_background(self.env_code(env_vars, restore=False))
            generation = self.generation
            msg_id, ex = self.submit(code, False)
            try:
                await self.stream(ex, emit, gone)
                if self.deno and generation == self.generation:
                    await self.flush_late(ex, emit)
            except ClientGone:
                # Interrupt the cell nobody waits for, so the next one runs; wait (a while) for
                # the kernel to settle, so that the next request is not aborted with this one.
                await self.km.interrupt_kernel()
                await self.wait_done(ex, limit=10)
                raise
            finally:
                self.executions.pop(msg_id, None)
                if env_vars and generation == self.generation:  # a restarted kernel has its own
                    await self.run_background(self.env_code(env_vars, restore=True))

    async def flush_late(self, cell, emit):
        """Deno's lines for `cell` that came after its idle status, or are still queued in the
        kernel: a silent flush's marker comes after them (bounded: a cell that broke
        Deno.jupyter only loses its late lines)."""
        msg_id, flush = self.submit(DENO_FLUSH, True, late_for=cell)
        try:
            await self.wait_done(flush, limit=DENO_FLUSH_S)
            if flush.done.is_set() and not flush.errored:
                await asyncio.wait_for(flush.flushed.wait(), DENO_FLUSH_S)
        except asyncio.TimeoutError:
            pass
        finally:
            self.executions.pop(msg_id, None)
        while not cell.queue.empty():
            line = cell.queue.get_nowait()
            if line is not None:
                await emit(line)

    async def stream(self, ex, emit, gone):
        loop = asyncio.get_running_loop()
        last_write = loop.time()
        while True:
            if gone():
                raise ClientGone()
            try:
                line = await asyncio.wait_for(ex.queue.get(), 0.5)
            except asyncio.TimeoutError:
                if not await self.km.is_alive():
                    await self.restart()  # ends `ex` with a ContextRestarting error
                elif loop.time() - last_write >= KEEPALIVE_S:
                    await emit({"type": "keepalive"})  # a write notices a client that left
                    last_write = loop.time()
                continue
            if line is None:
                return
            await emit(line)
            last_write = loop.time()


class Server:
    def __init__(self):
        self.contexts = {}
        self.defaults = {}  # language -> id of its default context
        self.default_lock = asyncio.Lock()

    async def create_context(self, language, cwd):
        if not os.path.isdir(cwd):
            raise FileNotFoundError(cwd)
        ctx = Context(language, cwd)
        await ctx.start()
        self.contexts[ctx.id] = ctx
        return ctx

    async def default_context(self, language):
        # TypeScript runs in javascript's default context: Deno's kernel runs both, and a
        # second Deno beside the first would cost ~100 MiB for nothing.
        language = "javascript" if language == "typescript" else language
        async with self.default_lock:
            ctx = self.contexts.get(self.defaults.get(language))
            if ctx is None:
                ctx = await self.create_context(language, HOME)
                self.defaults[language] = ctx.id
            return ctx

    def supported(self):
        specs = KernelSpecManager().find_kernel_specs()
        return sorted(lang for lang, kernel in KERNELS.items() if kernel in specs)

    def unsupported(self, language):
        return 400, f"Language {language!r} is not supported in this sandbox; supported: {', '.join(self.supported())}"

    # --- HTTP -------------------------------------------------------------------------------

    async def route(self, method, path, body, conn):
        parts = [p for p in path.split("?")[0].split("/") if p]
        if method == "GET" and parts == ["health"]:
            return await conn.reply(200, "OK")
        if method == "GET" and parts == ["contexts"]:
            # E2B lists a default javascript context beside python's. Started here, on first
            # ask, rather than before the template's snapshot: a kernel in the snapshot would
            # hand every sandbox restored from it the same Math.random state, which JavaScript
            # cannot reseed.
            if "javascript" in self.supported():
                try:
                    await self.default_context("javascript")
                except Exception as e:  # the list still answers; a run in javascript says why
                    print(f"the default javascript context did not start: {e!r}", file=sys.stderr)
            # The default contexts first (started lazily, javascript's may be newer than the
            # others); then the others in the order they were made.
            defaults = [self.contexts[i] for i in self.defaults.values() if i in self.contexts]
            rest = [c for c in self.contexts.values() if c not in defaults]
            return await conn.reply(200, [c.view() for c in defaults + rest])
        if method == "POST" and parts == ["contexts"]:
            req = conn.json(body)
            language = normalize_language(req.get("language"))
            try:
                ctx = await self.create_context(language, req.get("cwd") or HOME)
            except Unsupported:
                return await conn.text(*self.unsupported(language))
            except FileNotFoundError as e:
                return await conn.text(500, f"Failed to set working directory: {e} does not exist")
            return await conn.reply(200, ctx.view())
        if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart" and method == "POST":
            ctx = self.contexts.get(parts[1])
            if ctx is None:
                return await conn.text(404, f"Context {parts[1]} not found")
            await ctx.restart()  # without the lock: a cell that never ends is ended this way
            return await conn.reply(200, None)
        if len(parts) == 2 and parts[0] == "contexts" and method == "DELETE":
            ctx = self.contexts.pop(parts[1], None)
            if ctx is None:
                return await conn.text(404, f"Context {parts[1]} not found")
            await ctx.shutdown()
            return await conn.reply(200, None)
        if method == "POST" and parts == ["execute"]:
            req = conn.json(body)
            if not isinstance(req.get("code"), str):
                return await conn.reply(422, {"detail": "code is required and must be a string"})
            if req.get("context_id") and req.get("language"):
                return await conn.text(400, "Only one of context_id or language can be provided")
            if req.get("context_id"):
                ctx = self.contexts.get(req["context_id"])
                if ctx is None:
                    return await conn.text(404, f"Context {req['context_id']} not found")
            else:
                language = normalize_language(req.get("language"))
                try:
                    ctx = await self.default_context(language)
                except Unsupported:
                    return await conn.text(*self.unsupported(language))
            env_vars = {str(k): str(v) for k, v in (req.get("env_vars") or {}).items()}
            return await conn.stream(lambda emit, gone: ctx.execute(req["code"], env_vars, emit, gone))
        return await conn.reply(404, {"detail": "Not Found"})


class Conn:
    """One HTTP/1.1 connection: keep-alive, Content-Length or chunked bodies, chunked streams."""

    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer
        self.answered = False

    async def head(self):
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        return method, target, version, headers

    async def body(self, headers):
        if headers.get("transfer-encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await self.reader.readuntil(b"\r\n")
                    return bytes(out)
                out += await self.reader.readexactly(size)
                await self.reader.readexactly(2)
                if len(out) > MAX_BODY:
                    raise ValueError("body too large")
        n = int(headers.get("content-length") or 0)
        if n > MAX_BODY:
            raise ValueError("body too large")
        return await self.reader.readexactly(n) if n else b""

    def json(self, body):
        try:
            value = json.loads(body) if body else {}
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise BadBody()
        return value

    async def send_head(self, status, ctype, extra=""):
        self.answered = True
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 422: "Unprocessable Entity",
                  500: "Internal Server Error"}.get(status, "")
        self.writer.write(f"HTTP/1.1 {status} {reason}\r\ncontent-type: {ctype}\r\n{extra}\r\n".encode())

    async def send(self, status, ctype, data):
        await self.send_head(status, ctype, f"content-length: {len(data)}\r\n")
        self.writer.write(data)
        await self.writer.drain()

    async def reply(self, status, payload):
        await self.send(status, "application/json", json.dumps(payload).encode())

    async def text(self, status, message):
        await self.send(status, "text/plain; charset=utf-8", message.encode())

    async def stream(self, run):
        await self.send_head(200, "application/x-ndjson", "transfer-encoding: chunked\r\n")

        async def emit(line):
            data = (json.dumps(line) + "\n").encode()
            self.writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            try:
                await self.writer.drain()
            except (ConnectionError, OSError):
                raise ClientGone() from None

        def gone():
            # The client sends nothing while it reads the stream: an end of it means it left.
            r = self.reader
            return r.at_eof() or r.exception() is not None or self.writer.transport.is_closing()

        await run(emit, gone)
        await emit({"type": "end_of_execution"})
        self.writer.write(b"0\r\n\r\n")
        await self.writer.drain()

    async def serve(self, server):
        try:
            while True:
                try:
                    method, target, version, headers = await self.head()
                    body = await self.body(headers)
                except (ValueError, UnicodeDecodeError):
                    await self.text(400, "malformed request")
                    return
                self.answered = False
                try:
                    await server.route(method, target, body, self)
                except BadBody:
                    await self.reply(422, {"detail": "the body must be a JSON object"})
                except (ClientGone, ConnectionError):
                    raise
                except Exception as e:  # a kernel that failed to start, ...
                    if self.answered:
                        raise  # a stream already under way ends here
                    await self.text(500, f"{type(e).__name__}: {e}")
                close = headers.get("connection", "").lower() == "close" or version == "HTTP/1.0"
                if close:
                    return
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ClientGone, OSError):
            pass
        except Exception as e:
            print(f"code interpreter: {type(e).__name__}: {e}", file=sys.stderr)
        finally:
            self.writer.close()


async def main_async(host, port):
    server = Server()
    # The default Python kernel starts first: it is running before anyone can ask for it (and,
    # in a template, it is in the snapshot taken once the port answers).
    await server.default_context("python")
    listener = await asyncio.start_server(lambda r, w: Conn(r, w).serve(server), host, port, limit=MAX_HEAD)
    async with listener:
        await listener.serve_forever()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=49999)
    args = p.parse_args()
    os.chdir(HOME) if os.path.isdir(HOME) else None
    asyncio.run(main_async(args.host, args.port))


if __name__ == "__main__":
    sys.exit(main())
