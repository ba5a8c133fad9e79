"""Wire format of the Petals 2.x block protocol: messages, metadata keys, packing, uid chains.

Everything a server and a client must agree on lives here, written from the protocol's
facts (hivemind ``runtime_pb2`` messages, msgpack metadata, Petals' ``args_structure``
packing with ``b"__T<index>"`` markers, uid chains as `distconf.loader.naming` builds them):

- requests are ``ExpertRequest{uid, tensors, metadata}``; replies ``ExpertResponse{tensors, metadata}``;
- tensors go through ``hivemind.serialize_torch_tensor`` / ``deserialize_torch_tensor``;
- metadata is ``MSGPackSerializer.dumps(dict)`` with the ``KEY_*`` keys below;
- an optional tensor is a DUMMY: an empty tensor (``numel() == 0``).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import msgpack
import torch
from hivemind.compression.serialization import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.nested import nested_flatten, nested_pack
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import split_for_streaming

from distconf.dht.hivemind_compat import p2p_message_limits
from distconf.dht.hivemind_rpc_compat import MAX_EXT_DEPTH, guard_msgpack_depth, registered_ext_types
from distconf.dht.wire import TUPLE_EXT_CODE, WireError, check_shape
from distconf.loader.naming import chain_uid, parse_block_uid, split_chain

__all__ = [
    "COMPRESSED_SLACK", "WIRE_ITEMSIZE", "buffer_problem",
    "CACHE_TOKENS_AVAILABLE", "DEFAULT_MAX_MSG_SIZE", "DUMMY", "DUMMY_INT64", "HANDLER_CLASS_NAME",
    "KEY_ACTIVE_ADAPTER", "KEY_ALLOC_TIMEOUT", "KEY_ARGS_STRUCTURE", "KEY_MAX_LENGTH", "KEY_NEXT_SERVERS",
    "KEY_OUTPUT_COMPRESSION", "KEY_POINTS", "KEY_PUSH_FROM", "KEY_PUSHED", "KEY_SESSION_ID", "KEY_START_FROM_POSITION",
    "KEY_STEP_ID", "MAX_UNARY_PAYLOAD_SIZE", "NOT_SERVED", "ProtocolError", "chain_uid", "deserialize_tensors",
    "dumps_metadata",
    "is_dummy", "loads_metadata", "make_request", "pack_args_kwargs", "parse_chain", "read_request",
    "serialize_tensors", "serialized_size", "COMPRESSIONS", "compression_code", "split_chain", "stream_parts",
    "unpack_args_kwargs",
]

DEFAULT_MAX_MSG_SIZE, MAX_UNARY_PAYLOAD_SIZE = p2p_message_limits()
"""The p2p daemon's largest stream message and largest unary payload, in bytes (hivemind's limits)."""

NOT_SERVED = "Remote peer does not serve"
"""How a server refuses a block uid it does not serve (Petals 2.x's words; the uid follows)."""

HANDLER_CLASS_NAME = "TransformerConnectionHandler"
"""hivemind names a P2P handler ``f"{servicer class name}.{rpc name}"``; Petals 2.x servers and
clients use this class name, so handlers here are registered under it."""

KEY_MAX_LENGTH = "max_length"
KEY_SESSION_ID = "session_id"
KEY_STEP_ID = "step_id"
KEY_START_FROM_POSITION = "start_from_position"
KEY_NEXT_SERVERS = "next_servers"
KEY_PUSHED = "pushed"
KEY_PUSH_FROM = "push_from"
"""Step metadata from a session's own client: the base58 peer id of the one server allowed to push to
this session (the previous span's server), or ``""`` for none (a distconf extension; Petals ignores it)."""
KEY_ALLOC_TIMEOUT = "alloc_timeout"
KEY_POINTS = "points"
KEY_ARGS_STRUCTURE = "args_structure"
KEY_ACTIVE_ADAPTER = "active_adapter"
KEY_OUTPUT_COMPRESSION = "output_compression"
CACHE_TOKENS_AVAILABLE = "cache_tokens_available"
"""rpc_info key: bytes left in the server's cache // KV bytes per token of its largest block."""

DUMMY = torch.empty(0)
"""Stands for an absent float tensor (no deep prompts)."""
DUMMY_INT64 = torch.empty(0, dtype=torch.int64)
"""Stands for absent ``hypo_ids`` (no cache reordering)."""

_MARK = b"__T"


class ProtocolError(ValueError):
    """A message that does not follow the protocol (the text says which part and why)."""


def is_dummy(tensor: torch.Tensor) -> bool:
    """True for a DUMMY (an empty tensor)."""
    return tensor.numel() == 0


# ------------------------------------------------------------------ uids (`chain_uid`, `split_chain`: from naming)


def parse_chain(uids: str) -> tuple[str, list[int]]:
    """``(prefix, [indices])`` of a chain of consecutive blocks of one model; `ProtocolError` otherwise."""
    parts = split_chain(uids)
    if not parts:
        raise ProtocolError("the request names no block uid")
    prefix, indices = None, []
    for uid in parts:
        try:
            head, index = parse_block_uid(uid)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        if prefix is not None and head != prefix:
            raise ProtocolError(f"uids of two models in one chain: {prefix!r} and {head!r}")
        prefix = head
        indices.append(index)
    if any(b != a + 1 for a, b in itertools.pairwise(indices)):
        raise ProtocolError(f"blocks {indices[:16]} are not consecutive")
    assert prefix is not None
    return prefix, indices


# ------------------------------------------------------------------ args packing


def pack_args_kwargs(*args: Any, **kwargs: Any) -> tuple[list[torch.Tensor], Any]:
    """Flatten tensors out of ``(args, kwargs)``; the structure keeps ``b"__T<i>"`` in their place.

    The same tensor object appears once in the flat list (as in Petals 2.x).
    """
    flat: list[torch.Tensor] = []
    index_of: dict[int, int] = {}
    masked: list[Any] = []
    for value in nested_flatten((args, kwargs)):
        if isinstance(value, torch.Tensor):
            i = index_of.setdefault(id(value), len(flat))
            if i == len(flat):
                flat.append(value)
            masked.append(_MARK + str(i).encode())
        else:
            masked.append(value)
    return flat, nested_pack(masked, (args, kwargs))


def unpack_args_kwargs(flat_tensors: Sequence[torch.Tensor], structure: Any) -> tuple[Any, Any]:
    """Inverse of `pack_args_kwargs`: ``(args, kwargs)``. A bad structure raises `ProtocolError`."""
    values = []
    try:
        flat_args = _flat_args(structure)
        if flat_args is not None:  # every step message: a tuple of tensor marks and no kwargs
            return tuple(flat_tensors[int(value[len(_MARK):])] for value in flat_args), {}
        for value in nested_flatten(structure):
            if isinstance(value, bytes) and value.startswith(_MARK):
                values.append(flat_tensors[int(value[len(_MARK):])])
            else:
                values.append(value)
        args, kwargs = nested_pack(values, structure)
    except (ValueError, IndexError, TypeError, RecursionError) as exc:
        raise ProtocolError(f"args_structure does not match the {len(flat_tensors)} tensors sent: {exc}") from None
    return tuple(args), dict(kwargs)


def _flat_args(structure: Any) -> Sequence[bytes] | None:
    """The marks of a structure ``(args, {})`` whose args are all tensor marks, else None."""
    if type(structure) not in (tuple, list) or len(structure) != 2 or structure[1] != {}:
        return None
    args = structure[0]
    if type(args) not in (tuple, list) or not all(type(v) is bytes and v.startswith(_MARK) for v in args):
        return None
    return args


# ------------------------------------------------------------------ metadata and tensors


def dumps_metadata(metadata: dict[str, Any] | None) -> bytes:
    """Serialize request metadata (msgpack); ``None`` gives empty bytes."""
    return MSGPackSerializer.dumps(metadata) if metadata else b""


def _ext_hook(unknown: list[int], code: int, data: bytes, depth: int = 1) -> Any:
    """hivemind's msgpack ext types (tuples, registered classes); an unknown code is noted in ``unknown``.

    Tuples nest at most `MAX_EXT_DEPTH` levels: each level is a nested C decode (a few hundred kill
    the process, see `distconf.dht.hivemind_rpc_compat`)."""
    if code == TUPLE_EXT_CODE:
        if depth > MAX_EXT_DEPTH:
            raise ProtocolError(f"metadata nests tuples more than {MAX_EXT_DEPTH} levels deep")
        hook = functools.partial(_ext_hook, unknown, depth=depth + 1)
        return tuple(msgpack.loads(data, ext_hook=hook, raw=False))
    registered = registered_ext_types()
    if code in registered:
        guard_msgpack_depth()  # its decoder nests through hivemind's own hook: bound that one too (idempotent)
        return registered[code].unpackb(data)
    unknown.append(code)
    return data


def loads_metadata(raw: bytes) -> dict[str, Any]:
    """Parse request metadata; empty bytes give ``{}``; anything but a msgpack dict is a `ProtocolError`,
    and so is a dict holding msgpack ext values of types hivemind does not know (one error, not a log line each)."""
    if not raw:
        return {}
    unknown: list[int] = []
    try:
        value = msgpack.loads(raw, ext_hook=functools.partial(_ext_hook, unknown), raw=False)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"metadata is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if unknown:  # refused as a whole (hivemind's own hook would log one warning per value)
        raise ProtocolError(f"metadata holds {len(unknown)} msgpack ext values of unknown types "
                            f"(codes {sorted(set(unknown))[:8]})")
    if not isinstance(value, dict):
        raise ProtocolError(f"metadata must be a msgpack dict, got {type(value).__name__}")
    try:  # plain arrays and maps may nest 1,024 levels per tuple level: too deep for any reader
        check_shape(value, max_nesting=MAX_EXT_DEPTH)
    except WireError as exc:
        raise ProtocolError(f"metadata: {exc}") from None
    return value


_PLAIN_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.float64: "float64",
                 torch.int64: "int64", torch.int32: "int32"}
"""Dtypes whose ``NONE`` (de)serialization is done here, byte for byte as hivemind's ``NoCompression``
(bfloat16 and the rest go through hivemind, which has its own rules for them)."""
_PLAIN_NAMES = {name: dtype for dtype, name in _PLAIN_DTYPES.items()}
_NONE = runtime_pb2.CompressionType.NONE


WIRE_ITEMSIZE: dict[str, int] = {"float16": 2, "bfloat16": 4, "float32": 4, "float64": 8, "int64": 8}
"""Bytes per element of a tensor sent without compression, by dtype name (hivemind sends bfloat16 as float32):
the dtypes a block request or reply may carry."""
COMPRESSED_SLACK = 4096
"""Bytes a compressed tensor may carry beyond 4 per element (quantile and blockwise codes keep tables)."""


def buffer_problem(tensor: runtime_pb2.Tensor, numel: int) -> str | None:
    """What is wrong with ``tensor``'s buffer for ``numel`` values of its dtype and compression, read from its
    header before anything is decoded, as a predicate ("needs N bytes, its buffer has M"); None if nothing."""
    itemsize = WIRE_ITEMSIZE.get(tensor.dtype)
    if itemsize is None:
        return f"has dtype {tensor.dtype[:40]!r} (expected one of {', '.join(WIRE_ITEMSIZE)})"
    length = len(tensor.buffer)
    if tensor.compression == _NONE:
        if length != numel * itemsize:
            return f"needs {numel * itemsize} bytes, its buffer has {length}"
    elif tensor.compression not in runtime_pb2.CompressionType.values():
        return f"has unknown compression {tensor.compression}"
    elif length > 4 * numel + COMPRESSED_SLACK:
        return f"has {length} compressed bytes, more than {numel} values can need"
    return None


def _serialize_one(t: torch.Tensor, compression: int) -> runtime_pb2.Tensor:
    name = _PLAIN_DTYPES.get(t.dtype)
    if compression != _NONE and not t.numel():
        compression = _NONE  # an empty placeholder (no prompts): hivemind's 8-bit codecs fail on it
    if name is None or (compression != _NONE and t.is_floating_point()):
        kind = compression if t.is_floating_point() else _NONE
        return serialize_torch_tensor(t, kind)
    # hivemind's NoCompression without its per-call descriptor (a tenth of the time for a hidden state)
    return runtime_pb2.Tensor(compression=_NONE, buffer=t.numpy().tobytes(), size=t.shape, dtype=name)


def _deserialize_one(t: runtime_pb2.Tensor) -> torch.Tensor:
    dtype = _PLAIN_NAMES.get(t.dtype) if t.compression == _NONE else None
    shape = tuple(t.size)
    numel = math.prod(shape)
    buffer = t.buffer
    if dtype is None or len(buffer) != numel * dtype.itemsize or (t.requires_grad and not dtype.is_floating_point):
        return deserialize_torch_tensor(t)  # hivemind's path (and its errors) for everything else
    tensor = torch.frombuffer(bytearray(buffer), dtype=dtype) if numel else torch.empty(0, dtype=dtype)
    return tensor.reshape(shape).requires_grad_(t.requires_grad)


COMPRESSIONS: dict[str, int] = dict(runtime_pb2.CompressionType.items())
"""hivemind's tensor compressions by name (Petals' ``--compression``): NONE, MEANSTD_16BIT, FLOAT16, QUANTILE_8BIT,
UNIFORM_8BIT, BLOCKWISE_8BIT."""


def compression_code(name: str) -> int:
    """The ``runtime_pb2.CompressionType`` of ``name`` (any case); `ValueError` naming the choices."""
    code = COMPRESSIONS.get(name.upper())
    if code is None:
        raise ValueError(f"unknown compression {name!r}: one of {', '.join(COMPRESSIONS)}")
    return code


def serialize_tensors(tensors: Iterable[torch.Tensor], dtype: torch.dtype | None = None,
                      compression: int = runtime_pb2.CompressionType.NONE) -> list[runtime_pb2.Tensor]:
    """Serialize tensors (on CPU, detached); floating tensors are cast to ``dtype`` when given."""
    out = []
    for t in tensors:
        t = t.detach().cpu()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out.append(_serialize_one(t, compression))
    return out


def deserialize_tensors(serialized: Iterable[runtime_pb2.Tensor]) -> list[torch.Tensor]:
    """Deserialize tensors; a malformed one is a `ProtocolError` naming its position."""
    out = []
    for i, t in enumerate(serialized):
        try:
            out.append(_deserialize_one(t))
        except Exception as exc:
            raise ProtocolError(f"tensor {i} cannot be deserialized: {type(exc).__name__}: {exc}") from None
    return out


def serialized_size(serialized: Iterable[runtime_pb2.Tensor]) -> int:
    """Payload bytes of serialized tensors."""
    return sum(len(t.buffer) for t in serialized)


def make_request(uid: str, tensors: Sequence[runtime_pb2.Tensor], metadata: dict[str, Any] | None = None
                 ) -> runtime_pb2.ExpertRequest:
    """An ``ExpertRequest`` with already serialized tensors and dict metadata."""
    return runtime_pb2.ExpertRequest(uid=uid, tensors=list(tensors), metadata=dumps_metadata(metadata))


def read_request(request: runtime_pb2.ExpertRequest) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """``(tensors, metadata)`` of a request (`ProtocolError` on malformed content)."""
    return deserialize_tensors(request.tensors), loads_metadata(request.metadata)


def stream_parts(uid: str, serialized: Sequence[runtime_pb2.Tensor], metadata: bytes = b"",
                 chunk_size: int = DEFAULT_MAX_MSG_SIZE) -> Iterator[runtime_pb2.ExpertRequest]:
    """Requests of a stream call: tensors split with ``split_for_streaming``; each part carries uid and metadata."""
    for tensor in serialized:
        for part in split_for_streaming(tensor, chunk_size):
            yield runtime_pb2.ExpertRequest(uid=uid, tensors=[part], metadata=metadata)
