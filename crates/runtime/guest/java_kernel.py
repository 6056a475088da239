"""airlock's Java kernel: a Jupyter kernel (ipykernel's wrapper-kernel base) in front of
JShellBridge.java, JShell evaluating cells in one JVM. No Java kernel is packaged by the registries
the template builds from, so this one is ours: stdout and stderr stream as the cell writes them,
the last expression's value is the execute_result, an exception or a compile error is the cell's
error, and an interrupt stops the running cell and keeps the JVM and its state."""

import base64
import json
import os
import selectors
import subprocess
import sys

from ipykernel.kernelapp import IPKernelApp
from ipykernel.kernelbase import Kernel

BRIDGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "JShellBridge.java")
# Small-machine flags: one JIT tier and the serial collector start faster and take less memory.
JAVA = ["java", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Xss4m", "-Djava.awt.headless=true"]


class JavaKernel(Kernel):
    implementation = "airlock-java"
    implementation_version = "1"
    language = "java"
    language_version = "17"
    language_info = {"name": "java", "mimetype": "text/x-java", "file_extension": ".java"}
    banner = "Java (JShell)"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        reply_r, reply_w = os.pipe()
        # Its own session: the SIGINT an interrupt sends to the kernel's process group would end
        # the JVM; the kernel asks the bridge to stop the cell instead.
        self.jvm = subprocess.Popen(
            JAVA + [BRIDGE, f"/proc/self/fd/{reply_w}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=(reply_w,), start_new_session=True,
        )
        os.close(reply_w)
        self.replies = os.fdopen(reply_r, "rb", buffering=0)
        for f in (self.jvm.stdout, self.jvm.stderr, self.replies):
            os.set_blocking(f.fileno(), False)
        self.pending = b""

    def do_execute(self, code, silent, store_history=True, user_expressions=None, allow_stdin=False):
        if not code.strip():
            return self.ok()
        self.jvm.stdin.write(b"E " + base64.b64encode(code.encode()) + b"\n")
        self.jvm.stdin.flush()
        try:
            reply = self.wait_reply(silent)
        except KeyboardInterrupt:
            self.jvm.stdin.write(b"S\n")
            self.jvm.stdin.flush()
            reply = self.wait_reply(silent)
        if reply is None:
            return self.fail(silent, "JVMExited", "the Java process ended", [])
        if reply["status"] == "error":
            return self.fail(silent, reply["ename"], reply["evalue"], ["\n".join(reply["traceback"])])
        if reply["value"] is not None and not silent:
            self.send_response(self.iopub_socket, "execute_result", {
                "execution_count": self.execution_count,
                "data": {"text/plain": reply["value"]},
                "metadata": {},
            })
        return self.ok()

    def wait_reply(self, silent):
        """Stream the cell's output frames until the frame ending it (None if the JVM ended).
        The JVM's own stdout and stderr (its warnings) go out as stderr."""
        sel = selectors.DefaultSelector()
        sel.register(self.jvm.stdout, selectors.EVENT_READ)
        sel.register(self.jvm.stderr, selectors.EVENT_READ)
        sel.register(self.replies, selectors.EVENT_READ)
        try:
            while True:
                for key, _ in sel.select(timeout=1):
                    data = os.read(key.fileobj.fileno(), 65536)
                    if key.fileobj is not self.replies:
                        if data:
                            self.stream(silent, "stderr", data.decode(errors="replace"))
                        continue
                    if not data:
                        return None
                    self.pending += data
                    while b"\n" in self.pending:
                        line, self.pending = self.pending.split(b"\n", 1)
                        frame = json.loads(line)
                        if "stream" not in frame:
                            return frame
                        self.stream(silent, frame["stream"], frame["text"])
                if self.jvm.poll() is not None:
                    return None
        finally:
            sel.close()

    def stream(self, silent, name, text):
        if not silent:
            self.send_response(self.iopub_socket, "stream", {"name": name, "text": text})

    def ok(self):
        return {"status": "ok", "execution_count": self.execution_count, "payload": [], "user_expressions": {}}

    def fail(self, silent, ename, evalue, traceback):
        if not silent:
            self.send_response(self.iopub_socket, "error", {"ename": ename, "evalue": evalue, "traceback": traceback})
        return {"status": "error", "execution_count": self.execution_count,
                "ename": ename, "evalue": evalue, "traceback": traceback}

    def do_shutdown(self, restart):
        self.jvm.kill()
        self.jvm.wait()
        return {"status": "ok", "restart": restart}


if __name__ == "__main__":
    IPKernelApp.launch_instance(kernel_class=JavaKernel)
    sys.exit(0)
