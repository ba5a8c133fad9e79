"""Decoding untrusted DHT bytes without trusting their shape.

hivemind decodes stored values with ``MSGPackSerializer.loads``. Two kinds of bytes any
peer can store break it:

* values it cannot decode at all (a map with an integer key, lists nested past msgpack's
  own limit): the decode raises inside hivemind's search, and that key's result never
  arrives;
* tuples nested a few hundred levels deep: every tuple level is a msgpack extension
  decoded by a nested ``msgpack.unpackb`` call, each taking a large C stack frame, so
  about 200 levels overflow the stack and kill the whole process (seen with hivemind
  1.1.12 and msgpack 1.2.4 here).

`safe_loads` decodes a record with hard limits (size, nesting, items) and never
recurses without bound. (Making hivemind's own decoder refuse deep extension nesting is a
patch of hivemind: `distconf.dht.hivemind_rpc_compat.guard_msgpack_depth`.)

Imports only msgpack (a hivemind dependency) at call time.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "MAX_NESTING",
    "MAX_VALUE_BYTES",
    "TUPLE_EXT_CODE",
    "WireError",
    "check_shape",
    "safe_loads",
]

MAX_VALUE_BYTES = 16384
"""Largest serialized record accepted (a Petals 2.x server record with pings to 250
servers is about 14 KiB; ours are at most 2 KiB)."""
MAX_NESTING = 16
"""Deepest nesting of containers accepted in a record (server records nest 3 levels)."""
MAX_ITEMS_TOTAL = 8192
"""Most containers and scalars accepted in one record."""
TUPLE_EXT_CODE = 0x40
"""hivemind's msgpack extension code for tuples (``MSGPackSerializer._TUPLE_EXT_TYPE_CODE``,
checked by ``tests/test_hivemind_compat.py``)."""


class WireError(ValueError):
    """Bytes that are not a bounded, decodable msgpack value (the message says why)."""


def safe_loads(
    buf: bytes, *, max_bytes: int = MAX_VALUE_BYTES, max_nesting: int = MAX_NESTING, other_ext: bool = False
) -> Any:
    """Decode hivemind msgpack bytes like ``MSGPackSerializer.loads``, within limits.

    Tuples (hivemind's extension 0x40) are decoded; any other extension type is refused,
    or left undecoded as ``msgpack.ExtType`` when ``other_ext``. Map keys must be strings
    or bytes. Raises `WireError` for anything else, including values over ``max_bytes``
    bytes or nested deeper than ``max_nesting`` containers.
    """
    import msgpack

    if not isinstance(buf, (bytes, bytearray)):
        raise WireError(f"expected bytes, got {type(buf).__name__}")
    if len(buf) > max_bytes:
        raise WireError(f"value is {len(buf)} bytes serialized; at most {max_bytes} are accepted")
    depth = 0

    def hook(code: int, data: bytes) -> Any:
        nonlocal depth
        if code != TUPLE_EXT_CODE:
            if other_ext:
                return msgpack.ExtType(code, data)
            raise WireError(f"unexpected msgpack extension type {code}")
        depth += 1
        try:
            if depth > max_nesting:
                raise WireError(f"value is nested more than {max_nesting} levels deep")
            return tuple(msgpack.unpackb(data, ext_hook=hook, raw=False, strict_map_key=False))
        finally:
            depth -= 1

    try:
        value = msgpack.unpackb(bytes(buf), ext_hook=hook, raw=False, strict_map_key=False)
    except WireError:
        raise
    except Exception as e:  # msgpack raises ValueError subclasses, TypeError, StackError ...
        raise WireError(f"not decodable msgpack: {type(e).__name__}: {e}"[:200]) from None
    check_shape(value, max_nesting=max_nesting)
    return value


def check_shape(value: Any, *, max_nesting: int = MAX_NESTING, max_items: int = MAX_ITEMS_TOTAL) -> None:
    """Check a decoded value's nesting depth, item count and map keys without recursion; `WireError` if over.

    For any msgpack a peer sent: a value within these limits is safe to walk recursively.
    """
    stack = [(value, 0)]
    count = 0
    while stack:
        item, level = stack.pop()
        count += 1
        if count > max_items:
            raise WireError(f"value holds more than {max_items} items")
        if isinstance(item, (list, tuple)):
            if level >= max_nesting:
                raise WireError(f"value is nested more than {max_nesting} levels deep")
            stack.extend((x, level + 1) for x in item)
        elif isinstance(item, dict):
            if level >= max_nesting:
                raise WireError(f"value is nested more than {max_nesting} levels deep")
            for key, sub in item.items():
                if not isinstance(key, (str, bytes)):
                    raise WireError(f"map key {key!r:.40} is not a string (hivemind cannot decode it)")
                stack.append((sub, level + 1))
