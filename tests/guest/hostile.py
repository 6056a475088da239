"""Root inside a sandbox, against its own agent (PID 1). Run by tests/hostile.rs inside the guest.

  hostile.py takeover SECONDS   freeze every thread of the agent (ptrace), take a copy of its
                                virtio-serial port's fd (pidfd_getfd), then for SECONDS write
                                garbage into the channel and swallow all the host sends; at exit
                                the agent is let go (the tracer's exit detaches it)
  hostile.py kill               make the agent call exit_group(0) (ptrace: a thread stopped in a
                                syscall is pointed back at its `syscall` instruction with
                                rax = exit_group); PID 1 exiting panics the guest kernel

`kill -KILL 1` is no attack: the kernel drops signals to init that init has no handler for.
"""

import ctypes
import json
import os
import select
import sys
import time

libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
libc.syscall.restype = ctypes.c_long

PTRACE_PEEKTEXT, PTRACE_GETREGS, PTRACE_SETREGS, PTRACE_DETACH = 1, 12, 13, 17
PTRACE_SEIZE, PTRACE_INTERRUPT = 0x4206, 0x4207
WALL = 0x40000000
SYS_EXIT_GROUP, SYS_PIDFD_GETFD = 231, 438

# struct user_regs_struct, x86_64
REGS = ("r15 r14 r13 r12 rbp rbx r11 r10 r9 r8 rax rcx rdx rsi rdi orig_rax rip cs eflags rsp ss "
        "fs_base gs_base ds es fs gs").split()


class Regs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_ulonglong) for n in REGS]


def ptrace(req, tid, addr=None, data=None):
    ctypes.set_errno(0)
    r = libc.ptrace(req, tid, addr, data)
    err = ctypes.get_errno()
    if r == -1 and err:
        raise OSError(err, "ptrace(%d, %d): %s" % (req, tid, os.strerror(err)))
    return r


def freeze(pid=1):
    """Stop every thread of `pid` (PTRACE_SEIZE + PTRACE_INTERRUPT: no SIGSTOP, so the threads
    run on once this tracer detaches or exits)."""
    seized = []
    while True:
        new = [int(t) for t in os.listdir("/proc/%d/task" % pid) if int(t) not in seized]
        if not new:
            return seized
        for t in new:
            ptrace(PTRACE_SEIZE, t)
            ptrace(PTRACE_INTERRUPT, t)
            os.waitpid(t, WALL)
            seized.append(t)


def announce(what):
    """Say it on stdout and on the console, where the host reads it while the agent is frozen."""
    line = json.dumps(what)
    print(line, flush=True)
    try:
        with open("/dev/ttyS0", "w") as console:
            console.write("hostile.py: %s\n" % line)
    except OSError:
        pass


def agent_port_fd(pid=1):
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            if os.readlink("/proc/%d/fd/%s" % (pid, fd)).startswith("/dev/vport"):
                return int(fd)
        except OSError:
            pass
    sys.exit("PID 1 holds no /dev/vport*")


def takeover(seconds):
    target = agent_port_fd()
    threads = freeze()
    pidfd = os.pidfd_open(1)
    fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, target, 0)
    if fd < 0:
        sys.exit("pidfd_getfd: %s" % os.strerror(ctypes.get_errno()))
    announce({"frozen_threads": len(threads), "port_fd": target})
    junk = os.urandom(1 << 16)
    sent = swallowed = 0
    end = time.time() + seconds
    while time.time() < end:
        readable, writable, _ = select.select([fd], [fd], [], 0.2)
        if readable:
            try:
                n = len(os.read(fd, 1 << 16))
                swallowed += n
                if n == 0:  # the host is not connected: the port reports a hang-up
                    time.sleep(0.01)
            except OSError:
                time.sleep(0.01)
        if writable:
            try:
                sent += os.write(fd, junk)
            except OSError:
                time.sleep(0.01)
    announce({"sent": sent, "swallowed": swallowed})
    for t in threads:
        try:
            ptrace(PTRACE_DETACH, t, None, None)
        except OSError:
            pass


def kill():
    threads = freeze()
    for t in threads:
        regs = Regs()
        ptrace(PTRACE_GETREGS, t, None, ctypes.byref(regs))
        word = ptrace(PTRACE_PEEKTEXT, t, ctypes.c_void_p(regs.rip - 2), None)
        if word & 0xFFFF != 0x050F:  # not stopped right after a `syscall` instruction
            continue
        regs.rip -= 2
        regs.rax = SYS_EXIT_GROUP
        regs.rdi = 0
        regs.orig_rax = 2**64 - 1  # no syscall restart on the way out of the stop
        ptrace(PTRACE_SETREGS, t, None, ctypes.byref(regs))
        print("exit_group(0) set up in thread %d of %d" % (t, len(threads)), flush=True)
        for u in [u for u in threads if u != t] + [t]:  # the chosen thread last: it ends them all
            ptrace(PTRACE_DETACH, u, None, None)
        return
    sys.exit("no thread of PID 1 is stopped at a syscall")


if __name__ == "__main__":
    if sys.argv[1] == "takeover":
        takeover(float(sys.argv[2]))
    elif sys.argv[1] == "kill":
        kill()
    else:
        sys.exit("usage: hostile.py takeover SECONDS | kill")
