"""Attempt processes forked from a template that imported torch once.

Every attempt gets fresh processes (an RPC world or a communicator that saw a
failure is never reused), and a fresh Python spends about 2 s of CPU importing
torch and what a stage needs (torch._dynamo among it: building an optimizer
imports it). A job of W workers paid W + 1 such imports per attempt. Here one
template process, `python -m gpipe.service.zygote MODULE...`, imports those modules
once, and each attempt process is forked from it: it starts in milliseconds
and shares the imported pages with the template.

The template runs no operator, starts no thread of its own (numpy's BLAS pool
handles a fork itself) and never touches CUDA, so a fork of it is as clean as
a fresh interpreter that imported the same modules. A forked process:
- starts a session of its own (it is killed by process group, as before) and
  dies with the template, which dies with its owner (gpipe.proc);
- gets what `python -P -m MODULE ARGS` would have had: stdin, stdout and
  stderr, the environment (os.environ; /proc/PID/environ stays the
  template's, which holds none of the owner's secrets), the working
  directory, sys.path (PYTHONPATH included; never the working directory, so
  a job's folder cannot shadow the product's modules), sys.argv;
- applies first what the environment says at start-up: its cores
  (gpipe.proc.CORES_ENV), torch's threads (OMP_NUM_THREADS, else the
  template's default) and glibc's malloc thresholds (MALLOC_*_);
- runs MODULE as __main__, and exits as that interpreter would.
Its name (comm: what top and `ps -o comm` show) is "gpipe:" and its part
(process_name: gpipe:attempt, gpipe:worker, gpipe:cli, gpipe:template); its command line
stays the template's.

The owner (an agent or a launcher) talks to the template over a socketpair:
a request is one datagram of JSON, with the three descriptors of its stdio
attached. The template answers on its stdout, one JSON line each: `{"ready"}`
once imported, `{"pid"}` per request in order (or `{"error"}`), and
`{"exit", "code"}` when a process it forked ends (it is their parent, so it
reaps them). If the template cannot start or dies, the owner falls back to
starting the process as before.

A template may itself be a fork of another (Template's `parent`): it starts
once the parent is ready, as `python -m gpipe.service.zygote 0 MODULE...` with
its end of the socketpair as its stdin, and imports only what it adds to what
the parent imported. `run` so imports torch once for both its templates, and
the coordinator's attempt, forked from the parent, plans while the workers'
template is still importing torch._dynamo.

A template may also be shared by several owners: `python -m gpipe.service.zygote
--listen PATH MODULE...` accepts owners on a Unix socket at PATH, and an owner
whose environment names it (GPIPE_TEMPLATE_SOCKET, as the test suite sets for
each of its processes) connects there instead of starting a template of its
own (one in other network or mount namespaces starts its own, as its forks
would run in the template's). Each connection is one owner: its requests are as above, and the answers
(`{"ready"}` once imported, `{"pid"}`, `{"error"}`, `{"exit"}` for its own
forks only) come back on the connection, a datagram each. When an owner goes
away (its connection closes: it ended, or was killed) the template kills that
owner's forks by process group; those of the others run on. A fork dies with
the shared template too, as with a template of its own. Its start-up is the
shared template's: what runs as an interpreter starts (a sitecustomize on the
owner's PYTHONPATH, a .pth file) ran there, with the template's environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import socket
import struct
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

from gpipe.proc import CORES_ENV, PARENT_ENV, child_env

READY_TIMEOUT_S = 120.0  # importing torch on a loaded machine
FORK_TIMEOUT_S = 30.0  # a request's pid; the template that does not answer is killed, and processes start anew
COOL_OFF_S = 60.0  # after a template failed to start or answer, processes start anew this long
EXIT_REPORT_S = 2.0  # a fork that ended (its pidfd says so) whose exit the template does not report: -SIGKILL
MAX_REQUEST = 1 << 20  # one request: the module, its arguments, its environment
_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15
# mallopt's names for MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_, MALLOC_MMAP_THRESHOLD_: every one the workers set
# (gpipe.worker.agent.MALLOC_ENV), so that a fork of a template started without them (a shared one, or one forked
# from another template) has them all; a top pad left at glibc's 128 KiB re-faults a heap's top step after step
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": _M_TRIM_THRESHOLD, "MALLOC_TOP_PAD_": _M_TOP_PAD,
            "MALLOC_MMAP_THRESHOLD_": _M_MMAP_THRESHOLD}

SHARED_ENV = "GPIPE_TEMPLATE_SOCKET"  # the socket of a shared template (`--listen`) to fork from, if set


class Forked:
    """A process forked by the template, as much of asyncio.subprocess.Process as its owners use."""

    def __init__(self, pid: int, stdin: asyncio.StreamWriter | None, stdout: asyncio.StreamReader | None):
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self.returncode: int | None = None
        self._loop = asyncio.get_running_loop()
        self._ended = self._loop.create_future()
        # Its end, seen here too: the template reports the exit code, but one that cannot (dead or stopped)
        # must not leave a wait without an end.
        self._pidfd: int | None = None
        self._killed = False  # by its owner: once gone, its end is known without the template's report
        self._went = False  # its pidfd said it is gone
        try:
            self._pidfd = os.pidfd_open(pid)
            self._loop.add_reader(self._pidfd, self._gone)
        except OSError:  # it has ended already (the template's report follows), or no pidfd here
            self._pidfd = None

    def _gone(self) -> None:
        self._close_pidfd()
        self._went = True
        if self._killed:  # SIGKILL sent here: no code to wait for (a template closed with its parent's)
            self._end(-signal.SIGKILL)
        else:
            self._loop.call_later(EXIT_REPORT_S, self._end, -signal.SIGKILL)

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    def _end(self, code: int) -> None:
        self._close_pidfd()
        if self.returncode is None:
            self.returncode = code
            self._ended.set_result(code)

    async def wait(self) -> int:
        return int(await asyncio.shield(self._ended))

    def kill(self) -> None:
        if self.returncode is None:
            self._killed = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            if self._went:  # gone already, its report awaited: it will not come from a template killed too
                self._end(-signal.SIGKILL)


Child = asyncio.subprocess.Process | Forked


class Template:
    """One template process and the processes forked from it; `start` it before `spawn`, `close` it after."""

    def __init__(self, env: Mapping[str, str], preload: Iterable[str], hidden: Iterable[str] = (),
                 parent: Template | None = None):
        """`env`: the template's environment, less `hidden` (secrets its forks must not inherit). With `parent`,
        this template is itself forked from that one once it is ready, and imports `preload` on top of what the
        parent imported (torch, say): the two import at once, and the parent's forks start before this one's
        imports end."""
        self.env = {k: v for k, v in env.items() if k not in set(hidden) and k not in (PARENT_ENV, CORES_ENV)}
        self.shared = env.get(SHARED_ENV) or None  # a shared template's socket: connect, start none
        self.preload = list(preload)
        self.parent = parent
        self.proc: Child | None = None
        self.sock: socket.socket | None = None
        self.pending: deque[asyncio.Future[Forked]] = deque()
        self.children: dict[int, Forked] = {}
        self.ready: asyncio.Future[None] | None = None
        self._reader: asyncio.Task[None] | None = None
        self.not_before = float("-inf")  # monotonic time before which processes start anew (a failed template)
        self._starting = asyncio.Lock()  # one start at a time: two owners' first spawns start one template

    async def start(self) -> None:
        """Start the template importing (returns at once, or once the parent is ready and has forked it; `spawn`
        waits until it is ready). One that cannot start leaves processes to start anew, for COOL_OFF_S."""
        async with self._starting:
            await self._start()

    async def _start(self) -> None:
        # A template whose answers ended (self.sock gone) is ending, reaped or not yet: start anew.
        alive = self.proc is not None and self.proc.returncode is None and self.sock is not None
        if alive or time.monotonic() < self.not_before:
            return
        if self.shared is not None:
            self._connect(self.shared)
            if self.sock is not None or time.monotonic() < self.not_before:
                return
            self.shared = None  # in namespaces of its own: this owner starts a template of its own, below
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = child_env(dict(self.env, PYTHONUNBUFFERED="1"))
        try:
            if self.parent is not None:  # a fork of the parent, its end of the socketpair as its stdin
                self.proc = await self.parent.spawn("gpipe.service.zygote", ["0", *self.preload], env,
                                                    stdin=theirs.fileno(), stdout=True)
            else:
                self.proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-P", "-m", "gpipe.service.zygote", str(theirs.fileno()), *self.preload,
                    stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, start_new_session=True,
                    pass_fds=(theirs.fileno(),), env=env)
        except OSError:
            ours.close()
            self.not_before = time.monotonic() + COOL_OFF_S
            return
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours
        self.ready = asyncio.get_running_loop().create_future()
        assert self.proc.stdout is not None
        self._reader = asyncio.ensure_future(self._read(self.proc.stdout, ours, self.ready))

    def _connect(self, path: str) -> None:
        """Become an owner of the shared template at `path` (its answers come on the connection)."""
        if self.sock is not None:
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(path)
            sock.setblocking(False)
            pid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        except OSError:
            sock.close()
            self.not_before = time.monotonic() + COOL_OFF_S
            return
        if not _same_namespaces(pid):  # its forks would see another network (a host of a test's netns)
            sock.close()
            return
        self.sock = sock
        self.ready = asyncio.get_running_loop().create_future()
        self._reader = asyncio.ensure_future(self._read(_datagrams(sock), sock, self.ready))

    async def _read(self, messages: AsyncIterator[bytes], sock: socket.socket, ready: asyncio.Future[None]) -> None:
        try:
            async for line in messages:
                m = json.loads(line)
                if "ready" in m and not ready.done():
                    ready.set_result(None)
                elif "pid" in m or "error" in m:
                    f = self.pending.popleft()
                    if "error" in m:
                        if not f.done():
                            f.set_exception(OSError(m["error"]))
                        continue
                    # Known before anything else is read: its exit may be the very next line.
                    child = self.children[m["pid"]] = Forked(m["pid"], None, None)
                    if f.done():  # its spawn was cancelled: nobody owns it
                        child.kill()
                    else:
                        f.set_result(child)
                elif "exit" in m and m["exit"] in self.children:
                    self.children.pop(m["exit"])._end(m["code"])
        finally:  # the template ended: so did every process it forked (they die with it)
            # Whoever awaits these gets the error; one that stopped waiting (cancelled: its owner is
            # ending) must not have it logged as never retrieved: .exception() marks it seen.
            if not ready.done():
                ready.set_exception(OSError("the template process ended before it was ready"))
                ready.exception()
            for f in self.pending:
                if not f.done():
                    f.set_exception(OSError("the template process ended"))
                    f.exception()
            self.pending.clear()
            for child in self.children.values():  # they die with it; killed here too, and ended once gone
                child.kill()
                if child._pidfd is None:
                    child._end(-signal.SIGKILL)
            self.children.clear()
            if self.sock is sock:
                sock.close()
                self.sock = None

    async def spawn(self, module: str, args: list[str], env: Mapping[str, str], stdin: bool | int = False,
                    stdout: bool = False, limit: int = 1 << 16, stderr: int = 2) -> Child:
        """`python -m module *args` with `env`: forked from the template when it runs, else started anew.
        `stdin`, `stdout`: a pipe to write to, from which to read (else /dev/null); `stdin` may also be a
        descriptor of this process's that the child reads as its stdin; `stderr`: a descriptor of this
        process's to write to (default: this process's stderr)."""
        if time.monotonic() >= self.not_before:
            try:
                await self.start()
                if self.ready is None:
                    raise OSError("no template process")
                async with asyncio.timeout(READY_TIMEOUT_S):
                    await asyncio.shield(self.ready)
                return await self._fork(module, args, env, stdin, stdout, limit, stderr)
            except (OSError, TimeoutError):
                self.kill_now()
                self.not_before = time.monotonic() + COOL_OFF_S
        pipe, null = asyncio.subprocess.PIPE, asyncio.subprocess.DEVNULL
        given = null if stdin is False else pipe if stdin is True else stdin
        return await asyncio.create_subprocess_exec(
            sys.executable, "-P", "-m", module, *args, stdin=given, stdout=pipe if stdout else null,
            stderr=None if stderr == 2 else stderr, start_new_session=True, env=dict(env), limit=limit)

    async def _fork(self, module: str, args: list[str], env: Mapping[str, str], stdin: bool | int, stdout: bool,
                    limit: int, stderr: int) -> Forked:
        loop = asyncio.get_running_loop()
        close, keep = [], []  # the child's ends, sent and closed here; ours
        try:
            for wanted, writes in ((stdin, False), (stdout, True)):
                if wanted is not True and wanted is not False:  # the caller's descriptor, as it is
                    close.append(os.dup(wanted))
                elif wanted:  # a pipe: the child's end reads (stdin) or writes (stdout)
                    r, w = os.pipe()
                    close.append(w if writes else r)
                    keep.append(r if writes else w)
                else:
                    close.append(os.open(os.devnull, os.O_WRONLY if writes else os.O_RDONLY))
            request = json.dumps({"module": module, "args": args, "env": dict(env), "cwd": os.getcwd()}).encode()
            if len(request) > MAX_REQUEST:
                raise OSError(f"a request of {len(request)} bytes is over {MAX_REQUEST}")
            if self.sock is None:  # the template ended after it was ready: start this one anew (spawn)
                raise OSError("the template process ended")
            pid_f: asyncio.Future[Forked] = loop.create_future()
            socket.send_fds(self.sock, [request], [*close, stderr])  # a datagram on a local socketpair: never blocks
            self.pending.append(pid_f)
        except BaseException:
            for fd in keep:
                os.close(fd)
            raise
        finally:
            for fd in close:
                os.close(fd)
        try:
            async with asyncio.timeout(FORK_TIMEOUT_S):
                child = await asyncio.shield(pid_f)
        except BaseException:
            for fd in keep:
                os.close(fd)
            raise
        if stdin is True:
            transport, protocol = await loop.connect_write_pipe(
                asyncio.streams.FlowControlMixin, os.fdopen(keep.pop(0), "wb", 0))
            child.stdin = asyncio.StreamWriter(transport, protocol, None, loop)
        if stdout:
            reader = child.stdout = asyncio.StreamReader(limit=limit, loop=loop)
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader, loop=loop),
                                         os.fdopen(keep.pop(0), "rb", 0))
        return child

    async def close(self) -> None:
        """End the template (a shared one: this owner's connection), and with it every process it forked."""
        self._hang_up()
        proc, self.proc = self.proc, None
        if isinstance(proc, Forked):  # a template forked from another: its end is known once it is gone
            proc.kill()
            await proc.wait()
        elif proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reader, 10)

    def kill_now(self) -> None:
        """Kill the template without waiting (from a finally that cannot await)."""
        self._hang_up()
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)


    def _hang_up(self) -> None:
        """Leave a shared template: it kills this owner's forks, and the reader ends (killing them too)."""
        if self.shared is not None and self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)



def process_name(module: str) -> str:
    """A fork's name (comm, at most 15 bytes): "gpipe:" and its part, the room after gpipe's layer for our own
    modules (gpipe.coordinator.attempt.process: gpipe:attempt; gpipe.worker: gpipe:worker; a template:
    gpipe:template), else the module's last name."""
    if module == "gpipe.service.zygote":  # a template forked from another (Template's `parent`)
        return "gpipe:template"
    parts = module.split(".")
    if parts[0] == "gpipe" and len(parts) > 1:
        parts = parts[2:] if parts[1] in ("coordinator", "worker") and len(parts) > 2 else parts[1:]
        return f"gpipe:{parts[0]}"[:15]
    return f"gpipe:{parts[-1]}"[:15]

def _same_namespaces(pid: int) -> bool:
    """Whether process `pid` (a shared template) sees this process's network and mounts: its forks would."""
    try:
        return all(os.readlink(f"/proc/{pid}/ns/{ns}") == os.readlink(f"/proc/self/ns/{ns}") for ns in ("net", "mnt"))
    except OSError:
        return False


async def _datagrams(sock: socket.socket) -> AsyncIterator[bytes]:
    """A shared template's answers to this owner, until the connection ends."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            data = await loop.sock_recv(sock, 1 << 16)
        except OSError:
            return
        if not data:
            return
        yield data


# The template process.

def _say(m: dict[str, Any], to: socket.socket | None = None) -> None:
    """An answer: on stdout to the one owner (`to` None), else on a shared template's connection `to`, which
    an owner that reads nothing (gone, or stuck) does not hold up: what does not fit is dropped."""
    line = json.dumps(m).encode()
    if to is None:
        os.write(1, line + b"\n")
        return
    with contextlib.suppress(OSError):
        to.send(line, socket.MSG_DONTWAIT)


class _Owners:
    """Whose each fork is: the one owner's (on stdout), or a shared template's connection's."""

    def __init__(self, listener: socket.socket | None, first: socket.socket | None):
        self.listener, self.conns = listener, [first] if first is not None else []
        self.private = first  # the one owner's socketpair: answers go to stdout
        self.forks: dict[int, socket.socket | None] = {}  # pid -> its owner's connection (None once gone)

    def to(self, conn: socket.socket) -> socket.socket | None:
        return None if conn is self.private else conn

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.forks.pop(pid, None)
            if conn is not None:
                _say({"exit": pid, "code": os.waitstatus_to_exitcode(status)}, self.to(conn))

    def gone(self, conn: socket.socket) -> None:
        """A shared template's owner went away: so do its forks."""
        self.conns.remove(conn)
        conn.close()
        for pid, owner in self.forks.items():
            if owner is conn:
                self.forks[pid] = None
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)


def _serve(listener: socket.socket | None, first: socket.socket | None) -> tuple[dict[str, Any], list[int]] | None:
    """Fork a process per request until the one owner (`first`) goes away, or for ever for owners that connect
    to `listener` (a shared template); return (request, fds) in a forked process."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    owners = _Owners(listener, first)

    while True:
        fds_in = [c.fileno() for c in owners.conns] + [wake_r] + ([listener.fileno()] if listener else [])
        ready, _, _ = select.select(fds_in, [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            owners.reap()
        if listener is not None and listener.fileno() in ready:
            with contextlib.suppress(OSError):
                conn, _ = listener.accept()
                conn.setblocking(True)
                owners.conns.append(conn)
                _say({"ready": True}, conn)
        for conn in [c for c in owners.conns if c.fileno() in ready]:
            try:
                data, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
            except OSError:
                data, fds = b"", []
            if not data:  # the owner closed its end
                if conn is first:
                    return None
                owners.gone(conn)
                continue
            got = _fork(data, fds, conn, owners, (wake_r, wake_w))
            if got is not None:
                return got


def _fork(data: bytes, fds: list[int], conn: socket.socket, owners: _Owners,
          wake: tuple[int, int]) -> tuple[dict[str, Any], list[int]] | None:
    """Fork the process `data` asks for; return (request, fds) in it, None here."""
    led: tuple[int, int] | None = None
    try:
        request = json.loads(data)
        led = led_r, led_w = os.pipe()
        pid = os.fork()
    except (OSError, ValueError) as e:
        for fd in (*fds, *(led or ())):
            os.close(fd)
        _say({"error": str(e)}, owners.to(conn))
        return None
    if pid == 0:
        os.setsid()  # before its owner hears of it: it is killed by process group, and known by its name
        name = process_name(str(request.get("module", "")))
        ctypes.CDLL("libc.so.6").prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()))
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for c in (*owners.conns, *([owners.listener] if owners.listener else [])):
            c.close()  # an owner's connection held open here would keep its forks from being killed
        for fd in (*wake, led_r, led_w):
            os.close(fd)
        return request, fds
    owners.forks[pid] = conn
    os.close(led_w)
    if not select.select([led_r], [], [], FORK_TIMEOUT_S)[0]:  # end of file once the child led its session
        os.kill(pid, signal.SIGKILL)
    os.close(led_r)
    for fd in fds:
        os.close(fd)
    _say({"pid": pid}, owners.to(conn))
    return None


def _become(request: dict[str, Any], fds: list[int], template: int, template_env: dict[str, str]) -> str:
    """In the forked process: take on the request's process state; return the module to run."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != template:  # the template died before prctl took effect
        os._exit(1)
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    module: str = request["module"]
    env: dict[str, str] = request["env"]
    env.pop(PARENT_ENV, None)  # it dies with the template, which dies with the owner
    cores = env.pop(CORES_ENV, "")
    os.chdir(request["cwd"])
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    known = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    # As `python -P -m`: the working directory is not put on sys.path (the job's folder goes after the
    # product's own modules, gpipe.factory), the child's own PYTHONPATH entries ahead of the installed packages.
    sys.path[:0] = [p for p in paths if p not in known and p not in sys.path]
    os.environ.clear()
    os.environ.update(env)
    if cores:
        os.sched_setaffinity(0, [int(c) for c in cores.split(",")])
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    for name, param in _MALLOPT.items():  # glibc read the template's at its start; these differ
        if env.get(name, "").isdigit() and env[name] != template_env.get(name):
            libc.mallopt(param, min(int(env[name]), 2**31 - 1))  # mallopt takes an int
    import torch

    n = env.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(n) if n.isdigit() and int(n) > 0 else len(os.sched_getaffinity(0)))
    if "numpy" in sys.modules:  # seeded in the template: each process draws its own, as a fresh one would
        sys.modules["numpy"].random.seed()
    sys.argv = [module, *request["args"]]
    if not hasattr(sys.modules.get(module), "__path__"):  # a package's __main__ runs; the package stays
        sys.modules.pop(module, None)  # preloaded for its imports: run it afresh, as __main__
    return module


def main() -> None:
    """`python -m gpipe.service.zygote FD MODULE...` (one owner, on the socketpair FD) or `--listen PATH MODULE...`."""
    from gpipe import proc

    proc.adopt()
    listener = first = None
    if sys.argv[1] == "--listen":  # bound before the imports: an owner that connects waits for its "ready"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(sys.argv[2])
        os.chmod(sys.argv[2], 0o600)
        listener.listen(64)
        modules = sys.argv[3:]
    else:
        first = socket.socket(fileno=int(sys.argv[1]))  # the owner's requests; a fork closes it first thing
        modules = sys.argv[2:]
    for name in modules:
        importlib.import_module(name)
    template, template_env = os.getpid(), dict(os.environ)
    if first is not None:
        _say({"ready": True})
    got = _serve(listener, first)
    if got is None:
        return
    module = _become(*got, template=template, template_env=template_env)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
