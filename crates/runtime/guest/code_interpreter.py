#!/usr/bin/env python3
"""airlock's code interpreter: the API of E2B's code-interpreter server, in the sandbox.

POST /execute streams NDJSON (stdout, stderr, result, error, number_of_executions,
end_of_execution); /contexts manages contexts, each with its own persistent Python namespace.
Standard library only, plus matplotlib (Agg) when the code uses it.
"""
import argparse
import ast
import base64
import contextlib
import io
import json
import os
import queue
import sys
import threading
import traceback
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

os.environ.setdefault("MPLBACKEND", "Agg")


class Context:
    def __init__(self, language="python", cwd="/home/user"):
        self.id = str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        self.namespace = {"__name__": "__main__"}
        self.executions = 0

    def view(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}


CONTEXTS = {}
DEFAULT = {}
RUN_LOCK = threading.Lock()  # stdout/stderr are process-wide: one execution at a time


def now():
    return datetime.now(timezone.utc).isoformat()


class Stream(io.TextIOBase):
    """A stdout/stderr that turns every write into an output event."""

    def __init__(self, events, kind):
        self.events, self.kind, self.pending = events, kind, ""

    def writable(self):
        return True

    def write(self, text):
        # Whole lines become events as they complete, like a line-buffered terminal.
        self.pending += text
        while "\n" in self.pending:
            line, self.pending = self.pending.split("\n", 1)
            self.events.put({"type": self.kind, "text": line + "\n", "timestamp": now()})
        return len(text)

    def flush_rest(self):
        if self.pending:
            self.events.put({"type": self.kind, "text": self.pending, "timestamp": now()})
            self.pending = ""


def figures_as_results():
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return []
    out = []
    for num in plt.get_fignums():
        fig = plt.figure(num)
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        out.append({"type": "result", "png": base64.b64encode(buf.getvalue()).decode(), "text": repr(fig), "is_main_result": False})
    plt.close("all")
    return out


def value_result(value):
    result = {"type": "result", "text": repr(value), "is_main_result": True}
    for method, key in (("_repr_png_", "png"), ("_repr_html_", "html"), ("_repr_markdown_", "markdown"), ("_repr_svg_", "svg")):
        fn = getattr(value, method, None)
        if callable(fn):
            try:
                data = fn()
            except Exception:
                continue
            if data is not None:
                result[key] = base64.b64encode(data).decode() if isinstance(data, bytes) else data
    return result


SEEN_MACHINE_ID = [None]


def reseed_after_restore():
    """A sandbox restored from a base snapshot runs this process as the snapshot left it: its
    random state is every clone's. Each clone gets a machine id of its own over the channel, so
    a new one means: draw fresh random state (the modules a cell would share it through)."""
    try:
        with open("/etc/machine-id") as f:
            machine_id = f.read().strip()
    except OSError:
        return
    if machine_id == SEEN_MACHINE_ID[0]:
        return
    SEEN_MACHINE_ID[0] = machine_id
    if "random" in sys.modules:
        sys.modules["random"].seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def execute(ctx, code, env_vars, events):
    reseed_after_restore()
    ctx.executions += 1
    saved_env = dict(os.environ)
    os.environ.update({k: str(v) for k, v in (env_vars or {}).items()})
    old_cwd = os.getcwd()
    try:
        os.chdir(ctx.cwd)
    except OSError:
        pass
    out, err = Stream(events, "stdout"), Stream(events, "stderr")
    try:
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                tree = ast.parse(code, "<cell>", "exec")
                last = tree.body[-1] if tree.body and isinstance(tree.body[-1], ast.Expr) else None
                if last is not None:
                    tree.body = tree.body[:-1]
                exec(compile(tree, "<cell>", "exec"), ctx.namespace)
                value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), ctx.namespace) if last else None
        finally:
            out.flush_rest()
            err.flush_rest()
        for fig in figures_as_results():
            events.put(fig)
        if value is not None and not (type(value).__module__.startswith("matplotlib")):
            events.put(value_result(value))
    except BaseException as e:  # user code errors are data, not failures of the server
        tb_obj = e.__traceback__
        while tb_obj is not None and tb_obj.tb_frame.f_code.co_filename == __file__:
            tb_obj = tb_obj.tb_next  # the server's own frames are not the user's business
        tb = traceback.format_exception(type(e), e, tb_obj)
        events.put({"type": "error", "name": type(e).__name__, "value": str(e), "traceback": "".join(tb)})
    finally:
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    events.put({"type": "number_of_executions", "execution_count": ctx.executions})


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def body(self):
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        return json.loads(raw) if raw else {}

    def reply(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_GET(self):
        if self.path == "/health":
            return self.reply(200, "OK")
        if self.path == "/contexts":
            return self.reply(200, [c.view() for c in CONTEXTS.values()])
        self.reply(404, {"message": f"no route GET {self.path}"})

    def do_DELETE(self):
        if self.path.startswith("/contexts/"):
            cid = self.path.split("/")[2]
            if CONTEXTS.pop(cid, None) is None:
                return self.reply(404, {"message": f"Context {cid} not found"})
            DEFAULT.update({k: v for k, v in DEFAULT.items() if v != cid})
            return self.reply(200, {})
        self.reply(404, {"message": f"no route DELETE {self.path}"})

    def do_POST(self):
        try:
            req = self.body()
        except ValueError:
            return self.reply(400, {"message": "body is not JSON"})
        if self.path == "/contexts":
            language = req.get("language") or "python"
            if language != "python":
                return self.reply(400, {"message": f"language {language!r} is not supported; use python"})
            ctx = Context(language, req.get("cwd") or "/home/user")
            CONTEXTS[ctx.id] = ctx
            return self.reply(200, ctx.view())
        if self.path.startswith("/contexts/") and self.path.endswith("/restart"):
            cid = self.path.split("/")[2]
            ctx = CONTEXTS.get(cid)
            if ctx is None:
                return self.reply(404, {"message": f"Context {cid} not found"})
            ctx.namespace, ctx.executions = {"__name__": "__main__"}, 0
            return self.reply(200, {})
        if self.path != "/execute":
            return self.reply(404, {"message": f"no route POST {self.path}"})
        if req.get("context_id") and req.get("language"):
            return self.reply(400, {"message": "pass either context_id or language, not both"})
        if req.get("context_id"):
            ctx = CONTEXTS.get(req["context_id"])
            if ctx is None:
                return self.reply(404, {"message": f"Context {req['context_id']} not found"})
        else:
            language = req.get("language") or "python"
            if language != "python":
                return self.reply(400, {"message": f"language {language!r} is not supported; use python"})
            if language not in DEFAULT:
                ctx = Context(language)
                CONTEXTS[ctx.id] = ctx
                DEFAULT[language] = ctx.id
            ctx = CONTEXTS[DEFAULT[language]]
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = queue.Queue()

        def run():
            with RUN_LOCK:
                execute(ctx, req.get("code") or "", req.get("env_vars"), events)
            events.put(None)

        threading.Thread(target=run, daemon=True).start()
        try:
            while True:
                ev = events.get()
                if ev is None:
                    break
                self.chunk((json.dumps(ev) + "\n").encode())
            self.chunk((json.dumps({"type": "end_of_execution"}) + "\n").encode())
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=49999)
    args = p.parse_args()
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
