"""The hivemind patches every process that talks to peers applies: msgpack depth, p2pd's life, stream writes.

The second half of `distconf.dht.hivemind_compat` (items 1, 12, 13, 18, 19 and 20 of its numbering; the
DHT-node patches and the reads of private state are there). Importing this module runs the
same version check (`distconf.dht.hivemind_compat.check_hivemind_version`, one rule in
`distconf.versions`). `harden_peer_process` applies items 1 and 13 in one call: `distconf.rpc.calls`
calls it when it makes an event loop for RPCs (every server, client, API and chat process makes one
before its first RPC); `distconf.dht.node_process` installs items 1 and 12 in every DHT child when it starts
(and `distconf.dht.guard` item 1 again, for nodes it hardens). `distconf.rpc.protocol.loads_metadata`
bounds its own tuple decoding and calls item 1 before decoding a registered extension type.

1. `guard_msgpack_depth` wraps the classmethod ``MSGPackSerializer._decode_ext_types``
   (process-wide). *Why*: each tuple level is a msgpack extension that hivemind decodes
   with a nested ``msgpack.unpackb`` call; about 200 levels overflow the C stack and kill
   the process (msgpack 1.2.4; measured: 200 and 400 levels exit -11, 100 levels decode).
   Plain arrays and maps do not recurse in C: msgpack raises ``StackError`` past 1,024
   levels. Wrapped, nesting over ``limit`` raises ``ValueError``, which hivemind treats as
   a bad request or response. *If hivemind changes it*: a renamed method makes the install
   raise ``KeyError``; extension decoding that no longer goes through it leaves the process
   unguarded (the test decoding ``limit + 1`` nested tuples then fails).
12. `isolate_p2p_daemon` wraps ``asyncio.subprocess.create_subprocess_exec`` (process-wide;
    we call it in our DHT processes only) so that the ``p2pd`` binary ``hivemind.P2P.create``
    launches with it gets a process group of its own and, on Linux, dies (SIGTERM, its
    ``PR_SET_PDEATHSIG``) with the thread that started it: hivemind's DHT child starts it
    from its main thread, the one running the node, so p2pd goes when that process dies,
    however it dies (SIGKILL, SIGSEGV). *Why*: p2pd is a Go program that exits on SIGINT or
    SIGTERM; in its parent's process group it gets every signal sent to the group (Ctrl-C
    in a terminal, ``kill -- -PGID``, systemd's default ``KillMode``) and is gone before the
    server can announce OFFLINE through it. *If hivemind changes it*: a daemon started some
    other way is back in the caller's group (the test reading p2pd's process group fails),
    and one started from a short-lived thread would get its death signal when that thread
    ends (the crash tests, which find p2pd alive during serving and gone after, tell).
13. `coalesce_p2p_writes` replaces the static method ``P2P.send_protobuf`` (process-wide; we
    call it in every process that runs RPCs: clients and servers, see `distconf.rpc.calls`).
    *Why*: hivemind writes a stream message as three writes (marker byte, 8-byte length,
    body), i.e. three syscalls, and the daemons may forward them as three frames that wake
    the reader three times; one write of the same bytes is one. The bytes on the wire are
    hivemind's (``MESSAGE_MARKER`` or ``ERROR_MARKER``, ``HEADER_LEN`` big-endian length,
    the serialized message). *If hivemind changes it*: a new framing is not followed (the
    test comparing the bytes with the unpatched method fails).
18. `check_stream_message_lengths` wraps the static method ``P2P.receive_raw_data`` (process-wide; servers call
    it through `distconf.server.stream_limits`) so that a check sees each streamed message's announced length
    before its body is read. *Why*: hivemind reads the body whole, whatever length the 8-byte header says; a
    server refuses an oversized message before allocating it. *If hivemind changes it*: a renamed method makes
    the install raise ``KeyError``; reads that bypass it go unchecked (the stream-limit tests fail).
19. `read_frame` and `END_OF_STREAM_FRAME`: hivemind's stream framing (``P2P.receive_protobuf``'s marker byte,
    ``HEADER_LEN``-byte big-endian length, body; ``P2P.END_OF_STREAM``), read and written directly by
    `distconf.rpc.calls`' streams so that a step costs no queue or extra task. *If hivemind changes it*: the
    stream tests, which talk to hivemind's own handlers, fail.
20. `renew_future_locks` replaces hivemind's ``MPFuture`` locks (``MPFuture.reset_backend``) once a killed DHT
    process leaves the caller with no DHT process running (`distconf.dht.node_process.NodeProcess.kill_now`).
    *Why*: they are multiprocessing locks made at hivemind's import and shared with every DHT process the caller
    forks; a DHT process sends every reply holding ``MPFuture._update_lock``, so one killed mid-send left it held
    for ever, and every later node of the process waited out its start ("DHT node not ready"). *If hivemind
    changes it*: a reset that no longer replaces the locks leaves that hang possible again (the test killing a
    node that holds the lock fails).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from distconf.dht.hivemind_compat import _lock, _mark, _marked

__all__ = ["COALESCE_LIMIT", "END_OF_STREAM_FRAME", "MAX_EXT_DEPTH", "P2P_DAEMON_NAME", "FrameTooLarge",
           "check_stream_message_lengths", "coalesce_p2p_writes", "guard_msgpack_depth", "harden_peer_process",
           "isolate_p2p_daemon", "read_frame", "registered_ext_types", "renew_future_locks"]

MAX_EXT_DEPTH = 32
"""Deepest nesting of msgpack extension types hivemind may decode in a guarded process."""


def registered_ext_types() -> dict[int, Any]:
    """hivemind's registered msgpack extension types by code (the private ``MSGPackSerializer._ext_type_codes``).

    Read by `distconf.rpc.protocol.loads_metadata`, which decodes metadata with its own bounded hook.
    """
    from hivemind.utils.serializer import MSGPackSerializer

    return MSGPackSerializer._ext_type_codes


def harden_peer_process() -> None:
    """Apply the patches of a process that exchanges messages with peers (items 1, 13 and 17). Idempotent."""
    from distconf.dht.hivemind_p2p_compat import scalar_headers_for_numpy

    guard_msgpack_depth()
    coalesce_p2p_writes()
    scalar_headers_for_numpy()


# ----------------------------------------------------------------------------- 1. msgpack depth
def guard_msgpack_depth(limit: int = MAX_EXT_DEPTH) -> None:
    """Make hivemind's ``MSGPackSerializer`` refuse extension types nested over ``limit`` levels.

    Affects the calling process only: a value a peer crafted to overflow the C stack then
    raises ``ValueError`` instead of crashing the process. Idempotent (the first ``limit``
    stays). Reusable in any process that decodes hivemind msgpack from peers.
    """
    from hivemind.utils.serializer import MSGPackSerializer

    with _lock:
        current = MSGPackSerializer.__dict__["_decode_ext_types"].__func__
        if _marked(current):
            return
        state = threading.local()

        def _decode_ext_types(cls: type, type_code: int, data: bytes) -> Any:
            level = getattr(state, "level", 0)
            if level >= limit:
                raise ValueError(f"msgpack extension types nested more than {limit} levels deep")
            state.level = level + 1
            try:
                return current(cls, type_code, data)
            finally:
                state.level = level

        _decode_ext_types.__wrapped__ = current  # type: ignore[attr-defined]  # hivemind's own, for tests
        MSGPackSerializer._decode_ext_types = classmethod(_mark(_decode_ext_types))  # type: ignore[method-assign]


# ----------------------------------------------------------------------------- 12. p2pd process group and death
P2P_DAEMON_NAME = "p2pd"
"""File name of the p2p daemon binary hivemind ships and launches (``hivemind/hivemind_cli/p2pd``)."""
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def isolate_p2p_daemon() -> None:
    """Start every p2p daemon this process launches in its own process group, dying with this process.

    Signals sent to this process's group no longer reach the daemon; this process stops it
    (``P2P.shutdown``) when it is done with it. On Linux the daemon also gets SIGTERM when
    the thread that started it (this process's event loop thread) dies, however it dies.
    Process-wide; idempotent.
    """
    import asyncio.subprocess as aio_subprocess

    with _lock:
        unguarded = aio_subprocess.create_subprocess_exec
        if _marked(unguarded):
            return

        async def create_subprocess_exec(program: Any, *args: Any, **kwargs: Any) -> Any:
            if os.path.basename(os.fspath(program)) == P2P_DAEMON_NAME and "preexec_fn" not in kwargs:
                kwargs["preexec_fn"] = _detacher(os.getpid())
            return await unguarded(program, *args, **kwargs)

        aio_subprocess.create_subprocess_exec = _mark(create_subprocess_exec)  # type: ignore[assignment]


def _detacher(parent_pid: int) -> Callable[[], None]:
    """The function a forked daemon runs before ``exec``: own process group, death signal on Linux."""
    prctl = None
    if sys.platform.startswith("linux"):
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork, not in the child

    def detach() -> None:
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
            if os.getppid() != parent_pid:  # the parent died before the death signal was armed
                os._exit(1)

    return detach


# ----------------------------------------------------------------------------- 13. one write per message
COALESCE_LIMIT = 1 << 20
"""Largest message body (bytes) `coalesce_p2p_writes` copies to write it in one go; larger ones are written
as hivemind does (the copy would cost more than the syscalls it saves)."""


def coalesce_p2p_writes(limit: int = COALESCE_LIMIT) -> None:
    """Make ``P2P.send_protobuf`` write a message's marker, length and body in one write (the same bytes).

    Process-wide; idempotent.
    """
    from hivemind.p2p import P2P
    from hivemind.proto.p2pd_pb2 import RPCError

    with _lock:
        unguarded = P2P.__dict__["send_protobuf"].__func__
        if _marked(unguarded):
            return

        async def send_protobuf(protobuf: Any, writer: Any) -> None:
            data = protobuf.SerializeToString()
            if len(data) > limit:
                await unguarded(protobuf, writer)
                return
            marker = P2P.ERROR_MARKER if isinstance(protobuf, RPCError) else P2P.MESSAGE_MARKER
            writer.write(marker + len(data).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + data)
            await writer.drain()

        send_protobuf.__wrapped__ = unguarded  # type: ignore[attr-defined]  # hivemind's own, for tests
        P2P.send_protobuf = staticmethod(_mark(send_protobuf))  # type: ignore[method-assign]


_length_check: dict[str, Callable[[int], None] | None] = {"check": None}


def check_stream_message_lengths(check: Callable[[int], None] | None) -> None:
    """Call ``check(length)`` (it raises to refuse) before the body of every streamed message this process reads
    (None: no check). The patch is installed once; later calls only change the check."""
    from hivemind.p2p import P2P

    with _lock:
        _length_check["check"] = check
        unguarded = P2P.__dict__["receive_raw_data"].__func__
        if _marked(unguarded):
            return

        async def receive_raw_data(reader: Any) -> bytes:
            current = _length_check["check"]
            if current is None:
                return await unguarded(reader)
            header = await reader.readexactly(P2P.HEADER_LEN)
            length = int.from_bytes(header, P2P.BYTEORDER)
            current(length)
            return await reader.readexactly(length)

        receive_raw_data.__wrapped__ = unguarded  # type: ignore[attr-defined]
        P2P.receive_raw_data = staticmethod(_mark(receive_raw_data))  # type: ignore[method-assign]


class FrameTooLarge(ConnectionError):
    """A frame announcing more bytes than the reader takes (its body is not read)."""

    def __init__(self, length: int) -> None:
        super().__init__(f"a message of {length} bytes")
        self.length = length


def _end_of_stream_frame() -> bytes:
    from hivemind.p2p import P2P

    data = P2P.END_OF_STREAM.SerializeToString()
    return P2P.ERROR_MARKER + len(data).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + data


END_OF_STREAM_FRAME: bytes = _end_of_stream_frame()
"""The bytes hivemind sends to end a stream's input (an empty error message)."""


async def read_frame(reader: Any, max_bytes: int | None = None) -> tuple[str | None, bytes]:
    """The next message of a hivemind stream: ``(None, body)``, or ``(error message, b"")`` for the peer's error;
    `FrameTooLarge` (body unread) past ``max_bytes``; ``asyncio.IncompleteReadError`` at the end of the stream;
    ``ConnectionError`` for an unknown marker."""
    from hivemind.p2p import P2P
    from hivemind.proto.p2pd_pb2 import RPCError

    marker = await reader.readexactly(1)
    length = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
    if max_bytes is not None and length > max_bytes:
        raise FrameTooLarge(length)
    data = await reader.readexactly(length)
    if marker == P2P.MESSAGE_MARKER:
        return None, data
    if marker == P2P.ERROR_MARKER:
        error = RPCError()
        error.ParseFromString(data)
        return error.message, b""
    raise ConnectionError(f"a message of unknown type {marker!r}")


# ----------------------------------------------------------------------------- 20. MPFuture locks after a kill
def renew_future_locks() -> None:
    """Give this process new hivemind ``MPFuture`` locks (and a new reply pipe): call it only when none of its DHT
    processes is running, after one was killed (it may have died holding a lock; see item 20)."""
    from hivemind.utils.mpfuture import MPFuture

    MPFuture.reset_backend()
