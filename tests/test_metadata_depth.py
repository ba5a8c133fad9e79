"""`distconf.rpc.protocol.loads_metadata` refuses nesting no reader survives, in a process of its own.

The fast-tier companion of ``tests/test_hostile_runtime_crash.py`` (which sends the same bytes
to a real server): decoding runs in a child process, so a regression shows as its exit code
(-11) instead of killing the test worker. The child is unguarded (no RPC loop): the bound
must hold in `loads_metadata` itself.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from client_swarm import REPO

CHILD = r"""
import msgpack
from distconf.dht.wire import TUPLE_EXT_CODE
from distconf.rpc.protocol import ProtocolError, loads_metadata


def tuples(levels, leaf=b"\xc0"):
    for _ in range(levels):
        leaf = msgpack.packb(msgpack.ExtType(TUPLE_EXT_CODE, b"\x91" + leaf))
    return leaf


def dictionaries(levels, leaf=b"\xc0"):  # hivemind's registered DictionaryDHTValue, decoded by its own loads
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.utils.serializer import MSGPackSerializer

    code = next(c for c, t in MSGPackSerializer._ext_type_codes.items() if t is DictionaryDHTValue)
    for _ in range(levels):  # [maxsize, latest expiration, [(key, value, expiration)]]
        leaf = msgpack.packb(msgpack.ExtType(code, b"\x93\x00\x00\x91\x93\xa1k" + leaf + b"\x00"))
    return leaf


cases = {"tuples-400": tuples(400), "lists-990": b"\x91" * 990 + b"\xc0", "maps-5000": b"\x81\xa1k" * 5000 + b"\xc0",
         "tuples-30-of-lists-1000": tuples(30, b"\x91" * 1000 + b"\xc0"), "dictionaries-400": dictionaries(400)}
for name, deep in cases.items():
    try:
        loads_metadata(b"\x81" + msgpack.packb("args_structure") + deep)
        print(name, "accepted")
    except ProtocolError:
        print(name, "refused")
print("ok", loads_metadata(msgpack.packb({"args_structure": [[b"__T0"], {}]}, use_bin_type=True)) is not None)
"""


@pytest.mark.slow  # a few seconds: kept out of make test-fast
def test_deep_metadata_is_refused_without_a_crash() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n") == ["tuples-400 refused", "lists-990 refused", "maps-5000 refused",
                                       "tuples-30-of-lists-1000 refused", "dictionaries-400 refused", "ok True", ""]
