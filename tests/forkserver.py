"""Start the suite's Python processes by forking one preloaded interpreter instead of starting a new one each.

A ``distconf serve`` start spends about 4.5 of its 5.5 CPU-seconds importing torch, hivemind and
transformers' modeling code, and the suite starts a few hundred servers and command-line runs on
two cores. A fork server imports those once per pytest worker; each process is then a fork of
it that becomes the requested command (``python -m MODULE ...`` or ``python SCRIPT ...``, run as
``__main__`` by `runpy`) in a session of its own, with its own stdin/stdout/stderr, environment,
working directory and, for ``ip netns exec NS python ...``, network namespace. It is a real
process with its own pid; only the interpreter's start-up is skipped.

`ForkServer.popen` takes `subprocess.Popen`'s arguments and starts the process the ordinary way
whenever forking could differ from a new interpreter: another kind of command (``python -c``,
a non-Python program), or an environment that differs from the fork server's in a variable the
preloaded modules may read at import (anything but `PER_TEST_ENV` and distconf's own ``DISTCONF_*``:
distconf itself is imported after the fork; its thread policy, read before torch, must match).
`run` is `subprocess.run` through it. ``DISTCONF_TEST_FORKSERVER=0`` turns it off for a run.

Run as a script, this file is the fork server: it preloads, prints ``READY``, then serves
requests on a Unix socket until its stdin ends (the pytest worker exited), and kills the
process groups it started that are still running when it goes.
"""

from __future__ import annotations

import array
import atexit
import contextlib
import ctypes
import gc
import io
import json
import os
import runpy
import select
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
PRELOAD = ("torch", "hivemind", "transformers.modeling_utils", "safetensors.torch")
"""Imported once by the fork server: most of a process's start-up CPU."""
PER_TEST_ENV = frozenset({"PYTEST_CURRENT_TEST", "PYTHONUNBUFFERED", "PYTHONPATH", "TORCHINDUCTOR_CACHE_DIR"})
"""Variables besides ``DISTCONF_*`` that may differ between the fork server and a request: none is read at
import (torch sets the last one in the worker when transformers first asks for its cache directory)."""
CLONE_NEWNET = 0x40000000
MAX_FDS = 3

LAUNCHER: LazyForkServer | None = None
"""This worker's fork server, set by conftest (None: `run` and `ServerProcess` start new interpreters)."""


def _command(args: Sequence[str]) -> dict[str, Any] | None:
    """What the child must become for ``args``, or None when forking could differ from running ``args``.

    ``[ip netns exec NS] PYTHON (-m MODULE | SCRIPT.py) ARGS...`` with this interpreter's PYTHON.
    """
    args = list(args)
    netns = None
    if args[:3] == ["ip", "netns", "exec"] and len(args) > 4:
        netns, args = args[3], args[4:]
    if len(args) < 2 or args[0] != sys.executable:
        return None
    if args[1] == "-m" and len(args) > 2 and args[2].replace(".", "").replace("_", "").isalnum():
        return {"netns": netns, "module": args[2], "argv": args[3:]}
    if args[1].endswith(".py") and os.path.isfile(args[1]):
        return {"netns": netns, "script": os.path.abspath(args[1]), "argv": args[2:]}
    return None


def _recv_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One request: a JSON object on one line and three descriptors (stdin, stdout, stderr)."""
    fds = array.array("i")
    data, ancdata, _, _ = conn.recvmsg(1 << 16, socket.CMSG_LEN(MAX_FDS * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    while data and not data.endswith(b"\n") and len(data) < 1 << 24:
        data += conn.recv(1 << 16)
    return json.loads(data), list(fds)


def _enter_netns(name: str) -> None:
    """Move this process into the network namespace ``ip netns`` calls ``name`` (what ``ip netns exec`` does
    for the network; its private /sys mount is not needed by what the suite runs there)."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


PRELOAD_EXIT_HANDLERS: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []
"""The exit handlers the preloaded modules registered (`atexit`): a forked child runs them itself at its exit."""
_exit_code: int | None = None
"""In a forked child: the exit code of the command once it ended (None: it ended by KeyboardInterrupt)."""


def _preload() -> None:
    """Import `PRELOAD`, recording the exit handlers the imports register, then freeze what they allocated.

    `gc.freeze` keeps the preloaded objects out of every later collection: a forked child's collections
    (and the last one at its exit) would otherwise visit them all, writing to each object's page, and each
    such write copies a page the child shares with this process (a forked child's exit took 1.05 CPU-s
    without the freeze, 0.31 with it, measured).
    """
    register = atexit.register

    def recording(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        PRELOAD_EXIT_HANDLERS.append((func, args, kwargs))
        return register(func, *args, **kwargs)

    atexit.register = recording
    try:
        for name in PRELOAD:
            __import__(name)
    finally:
        atexit.register = register
    gc.freeze()


def _exit_without_teardown() -> None:
    """A forked child's last exit handler: run the preloaded modules' handlers as the interpreter would, flush,
    and end the process without tearing down the preloaded modules.

    Registered first in the child, it runs after every handler the command registered and after its
    non-daemon threads ended. Tearing down the modules touched every preloaded object, copying the pages
    the child shares with the fork server: 0.3 CPU-s per process for nothing. After a KeyboardInterrupt
    the interpreter finishes as usual (it ends the process by SIGINT).
    """
    if _exit_code is None:
        return
    for func, args, kwargs in reversed(PRELOAD_EXIT_HANDLERS):
        try:
            func(*args, **kwargs)
        except Exception:  # as atexit does: report it and go on with the next handler
            traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(_exit_code)


def _run_child(request: dict[str, Any], fds: list[int], path: str) -> None:
    """In the forked child: become the requested command and run it.

    With ``fork_servers`` in the request, the command's own `distconf.tools.serving.ServerProcess`
    starts (the demo's servers) are requests to this fork server too (at ``path``).

    It ends by raising `SystemExit` (the command's own, or 0), which unwinds the fork server's loop
    in this process, so the interpreter exits as a new one would: non-daemon threads, exit handlers,
    flushed output; an uncaught exception prints its traceback and exits 1. Only the teardown of the
    modules is skipped (`_exit_without_teardown`).
    """
    os.setsid()
    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.set_wakeup_fd(-1)
    reference = dict(os.environ)  # the fork server's: what its preloaded modules read
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True,
                                  write_through=bool(os.environ.get("PYTHONUNBUFFERED")))
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)
    if request["netns"]:
        _enter_netns(request["netns"])
    # distconf applies its thread policy at start and warns when torch came first. Here torch came first by
    # design, with the same policy (the environments match and conftest makes it the same for every role).
    import logging

    logging.getLogger("distconf.threads").addFilter(lambda record: "after torch was imported" not in record.msg)
    import torch

    torch.seed()  # a new process seeds its generator from the OS; a fork would share the parent's state
    # hivemind's MPFuture locks are multiprocessing locks made at its import: every fork would share them, and one
    # forked process killed while holding one (a client a test kills) would block every DHT node forked after it.
    # A new interpreter makes its own; so does this fork.
    from hivemind.utils.mpfuture import MPFuture

    MPFuture.reset_backend()
    if request.get("fork_servers"):
        from distconf.tools import serving

        serving.set_launcher(ForkClient(path, reference))
    # PYTHONPATH as a new interpreter reads it (sys.path[0], the fork server's own folder, is replaced below)
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path[1:]]
    global _exit_code
    atexit.register(_exit_without_teardown)
    try:
        if "module" in request:
            sys.path[0:1] = [os.getcwd(), *extra]
            sys.argv = [request["module"], *request["argv"]]  # runpy puts the module's file first
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            sys.path[0:1] = [os.path.dirname(request["script"]), *extra]
            sys.argv = [request["script"], *request["argv"]]
            runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as exc:  # the interpreter prints a message that is not an int, and exits 1
        _exit_code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        raise
    except KeyboardInterrupt:
        raise
    except BaseException:  # the interpreter prints the traceback and exits 1
        _exit_code = 1
        raise
    _exit_code = 0
    raise SystemExit(0)


def _status(raw: int) -> int:
    """`subprocess.Popen.returncode` for a `os.waitpid` status (minus the signal for a signalled process)."""
    return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)


def serve(path: str) -> None:
    """The fork server's loop (in its own process): fork on each request, report each exit, stop at stdin's end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the pytest worker's to handle; it closes our stdin
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = socket.socketpair()
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection its exit status goes to
    started_by: dict[int, int] = {}  # child pid -> the pid of the process that asked for it
    nested_cpu: dict[int, float] = {}  # child pid -> CPU of the exited processes it asked for (reported with its)
    print("READY", flush=True)
    running = True
    while running:
        for key, _ in selector.select(timeout=1.0):
            if key.data == "stdin":
                running = bool(os.read(sys.stdin.fileno(), 4096))
            elif key.data == "accept":
                conn, _ = listener.accept()
                requester = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                struct.calcsize("3i")))[0]
                request, fds = _recv_request(conn)
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    for closing in (listener, wake_r, wake_w, *waiting.values(), conn):
                        closing.close()
                    _run_child(request, fds, path)
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"{pid}\n".encode())
                waiting[pid] = conn
                started_by[pid] = requester
            else:
                with contextlib.suppress(BlockingIOError):
                    wake_r.recv(4096)
        while waiting:
            try:
                pid, raw, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            cpu = usage.ru_utime + usage.ru_stime + nested_cpu.pop(pid, 0.0)
            requester = started_by.pop(pid, None)
            if requester in waiting:  # a server a forked command started (fork_servers): that command's CPU
                nested_cpu[requester] = nested_cpu.get(requester, 0.0) + cpu
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(f"{_status(raw)} {cpu:.3f}\n".encode())
                conn.close()
    for pid in waiting:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


class ForkedProcess:
    """The part of `subprocess.Popen` the suite uses, for a process the fork server started."""

    def __init__(self, conn: socket.socket, args: Sequence[str], stdin: IO[str] | None, stdout: IO[str] | None,
                 stderr: IO[str] | None, on_exit: Callable[[float], None]) -> None:
        self.args = list(args)
        self._conn = conn
        self._buffer = b""
        self._on_exit = on_exit
        self._lock = threading.Lock()
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None
        self.pid = int(self._read_line(timeout=30.0) or "0")
        if not self.pid:
            raise OSError("the fork server did not start the process")

    def _read_line(self, timeout: float | None) -> str | None:
        """The next line from the fork server ("" when it closed the connection; None after ``timeout``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return None
            chunk = self._conn.recv(256)
            if not chunk:
                return ""
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode().strip()

    def poll(self) -> int | None:
        """The exit code if the process has exited, else None (never blocks, even while another thread waits)."""
        if self.returncode is None and self._lock.acquire(blocking=False):
            try:
                self._collect(0.0)
            finally:
                self._lock.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait up to ``timeout`` seconds for the exit code (`subprocess.TimeoutExpired` after)."""
        with self._lock:
            self._collect(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def _collect(self, timeout: float | None) -> None:
        if self.returncode is None:
            line = self._read_line(timeout)
            if line is not None:
                code, _, cpu = line.partition(" ")
                self.returncode = int(code) if code else -signal.SIGKILL  # the fork server itself was killed
                self._conn.close()
                self._on_exit(float(cpu or 0.0))

    def communicate(self, input: str | None = None, timeout: float | None = None) -> tuple[str, str]:
        """`subprocess.Popen.communicate` for text pipes: write ``input``, read stdout and stderr to their ends."""
        if self.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                if input:
                    self.stdin.write(input)
                self.stdin.close()
        chunks: dict[Any, list[str]] = {stream: [] for stream in (self.stdout, self.stderr) if stream is not None}
        deadline = None if timeout is None else time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            for stream in chunks:
                selector.register(stream, selectors.EVENT_READ)
            while selector.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
                for key, _ in selector.select(left):
                    data = os.read(key.fd, 1 << 16)
                    if data:
                        chunks[key.fileobj].append(data.decode("utf-8", "replace"))
                    else:
                        selector.unregister(key.fileobj)
        self.wait(None if deadline is None else max(0.1, deadline - time.monotonic()))
        for stream in chunks:
            stream.close()
        return "".join(chunks.get(self.stdout, [])), "".join(chunks.get(self.stderr, []))

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the process (nothing once it has exited)."""
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)


class ForkClient:
    """Requests to a running fork server (at ``path``, preloaded with environment ``env``): `popen` forks."""

    def __init__(self, path: str, env: Mapping[str, str]) -> None:
        self.path = path
        self.env = dict(env)
        self.reaped_cpu = 0.0
        """CPU seconds of the forked processes collected so far, with what they reaped (DHT and P2P daemons) and,
        for a command started with ``fork_servers``, the servers it started that exited before it."""

    def forks(self, args: Sequence[str], env: Mapping[str, str] | None) -> bool:
        """Whether ``args``/``env`` can be forked from the preloaded interpreter without any difference."""
        return _command(args) is not None and _same_env(env, self.env)

    def popen(self, args: Sequence[str], *, stdin: Any = None, stdout: Any = None, stderr: Any = None,
              env: Mapping[str, str] | None = None, cwd: str | Path | None = None, text: bool = False,
              bufsize: int = -1, start_new_session: bool = False, fork_servers: bool = False,
              **kwargs: Any) -> Any:
        """`subprocess.Popen` (same arguments): forked when `forks` allows, else a new interpreter.

        A forked process always leads a session of its own; its pipes, if any, are text. ``fork_servers``: the
        servers it starts through `distconf.tools.serving.ServerProcess` are forked by the same fork server.
        """
        command = _command(args)
        pipes = subprocess.PIPE in (stdin, stdout, stderr)
        if kwargs or (pipes and not text) or command is None or not self.forks(args, env):
            return subprocess.Popen(list(args), stdin=stdin, stdout=stdout, stderr=stderr, env=env, cwd=cwd,
                                    text=text, bufsize=bufsize, start_new_session=start_new_session, **kwargs)
        mine: list[int] = []  # descriptors this process keeps (the parent ends of pipes)
        theirs: list[int] = []  # descriptors handed to the child (closed here once sent)
        try:
            child_in, parent_in = _end(stdin, 0, mine, theirs)
            child_out, parent_out = _end(stdout, 1, mine, theirs)
            child_err, parent_err = (child_out, None) if stderr == subprocess.STDOUT else _end(stderr, 2, mine,
                                                                                                 theirs)
            request = {**command, "env": dict(os.environ if env is None else env), "cwd": str(cwd or os.getcwd()),
                       "fork_servers": fork_servers}
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(self.path)
                fds = array.array("i", [child_in, child_out, child_err])
                conn.sendmsg([json.dumps(request).encode() + b"\n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
                return ForkedProcess(conn, args, _wrap(parent_in, "w", bufsize), _wrap(parent_out, "r", bufsize),
                                     _wrap(parent_err, "r", bufsize), self._reaped)
            except BaseException:
                conn.close()
                for fd in mine:
                    os.close(fd)
                raise
        finally:
            for fd in theirs:
                os.close(fd)

    __call__ = popen  # a `distconf.tools.serving.Launcher`

    def _reaped(self, cpu: float) -> None:
        self.reaped_cpu += cpu


class ForkServer(ForkClient):
    """A preloaded interpreter of this pytest worker that forks Python processes on request."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        """Start the fork server with ``env`` (default: this process's); it forks only for requests with that env."""
        self._dir = tempfile.mkdtemp(prefix="distconf-fork-")
        super().__init__(os.path.join(self._dir, "socket"), os.environ if env is None else env)
        self.proc = subprocess.Popen([sys.executable, __file__, self.path], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True,
                                     env={**self.env, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        line = self.proc.stdout.readline().strip() if ready else ""
        if line != "READY":
            self.close()
            raise RuntimeError(f"the fork server did not start (said {line!r})")

    def forks(self, args: Sequence[str], env: Mapping[str, str] | None) -> bool:
        """Whether the fork server runs and ``args``/``env`` can be forked without any difference."""
        return self.proc.poll() is None and super().forks(args, env)

    def close(self) -> None:
        """Stop the fork server (it kills what it started that still runs) and remove its socket."""
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            os.rmdir(self._dir)


class LazyForkServer:
    """A `distconf.tools.serving.Launcher` that starts its `ForkServer` on the first request it can fork."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self._server: ForkServer | None = None
        self._closed = False
        self._lock = threading.Lock()

    @property
    def reaped_cpu(self) -> float:
        """CPU seconds of the forked processes collected so far; 0 once closed (the fork server was reaped,
        and its CPU with its children's counts in this process's children's since)."""
        return 0.0 if self._server is None or self._closed else self._server.reaped_cpu

    def server(self) -> ForkServer:
        """The fork server, started now if it was not yet."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the fork server of this worker was closed")
            if self._server is None:
                self._server = ForkServer(self.env)
            return self._server

    def __call__(self, args: Sequence[str], **kwargs: Any) -> Any:
        """`subprocess.Popen`: forked from the preloaded interpreter when `ForkServer.forks` allows."""
        if self._server is None and not self._closed and _command(args) and _same_env(kwargs.get("env"), self.env):
            self.server()
        if self._server is None or self._closed:
            kwargs.pop("fork_servers", None)
            return subprocess.Popen(list(args), **kwargs)
        return self._server.popen(args, **kwargs)

    def close(self) -> None:
        """Stop the fork server if it was started."""
        with self._lock:
            if self._server is not None and not self._closed:
                self._server.close()
            self._closed = True


_scripts: dict[str, str] = {}
"""The files `script` wrote in this process, by their code."""


def script(code: str) -> str:
    """A ``.py`` file holding ``code`` (written once per process, removed at exit): ``[sys.executable, script(code),
    *args]`` runs as ``[sys.executable, "-c", code, *args]`` does, but is forked from the preloaded interpreter
    (a ``-c`` command is always a new one). Its ``sys.path[0]`` is the file's folder instead of the working
    directory: give the code what it imports through ``PYTHONPATH``."""
    if code not in _scripts:
        folder = tempfile.mkdtemp(prefix="distconf-test-script-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        path = os.path.join(folder, "script.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(code)
        _scripts[code] = path
    return _scripts[code]


def popen(args: Sequence[str], **kwargs: Any) -> Any:
    """`subprocess.Popen(args, **kwargs)`, forked by this worker's fork server if it can."""
    return (LAUNCHER if LAUNCHER is not None else subprocess.Popen)(list(args), **kwargs)


def run(args: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
        input: str | None = None, fork_servers: bool = False) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(args, capture_output=True, text=True, ...)`, forked by this worker's fork server if it can.

    ``fork_servers``: the servers the command starts through `distconf.tools.serving.ServerProcess` (the demo's)
    are forked too, when the command itself is.
    """
    launch: Callable[..., Any] = LAUNCHER if LAUNCHER is not None else subprocess.Popen
    extra = {"fork_servers": True} if fork_servers and LAUNCHER is not None else {}
    proc = launch(list(args), stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=None if env is None else dict(env), cwd=cwd,
                  text=True, bufsize=-1, start_new_session=True, **extra)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        raise
    return subprocess.CompletedProcess(list(args), proc.returncode, out, err)


def _same_env(env: Mapping[str, str] | None, reference: Mapping[str, str]) -> bool:
    env = os.environ if env is None else env
    return all(env.get(k) == reference.get(k) for k in (env.keys() | reference.keys()) - PER_TEST_ENV
               if not k.startswith("DISTCONF_") or k.startswith("DISTCONF_THREADS"))


def _end(spec: Any, standard: int, mine: list[int], theirs: list[int]) -> tuple[int, int | None]:
    """The child's descriptor for Popen's stdin/stdout/stderr value ``spec`` (``standard``: 0, 1 or 2; None
    inherits this process's), and the parent's pipe end if any."""
    write = standard != 0
    if spec == subprocess.PIPE:
        read, written = os.pipe()
        child, parent = (written, read) if write else (read, written)
        mine.append(parent)
        theirs.append(child)
        return child, parent
    if spec is None:
        return standard, None
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_WRONLY if write else os.O_RDONLY)
        theirs.append(fd)
        return fd, None
    return (spec if isinstance(spec, int) else spec.fileno()), None


def _wrap(fd: int | None, mode: str, bufsize: int) -> IO[str] | None:
    """The parent's end of a pipe as a text file, buffered as `subprocess.Popen(text=True, bufsize=...)`."""
    if fd is None:
        return None
    return open(fd, mode, buffering=bufsize, encoding="utf-8", errors="replace")


if __name__ == "__main__":
    serve(sys.argv[1])
