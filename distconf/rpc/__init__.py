"""The Petals 2.x block protocol shared by distconf's server and client.

`protocol` holds the wire format (messages, metadata keys, ``args_structure`` packing,
uid chains, DUMMY tensors); `servicer` the handler names (`BlockServicer`); `calls` one
bounded helper per RPC plus `RpcLoop`, a background loop with a P2P replicated from a DHT.
Importing this package imports torch and hivemind.
"""

from distconf.rpc.calls import (
    InferenceStream,
    RpcLoop,
    as_peer_id,
    call_backward,
    call_forward,
    call_info,
    call_push,
    get_stub,
    inference_step_request,
)
from distconf.rpc.protocol import (
    CACHE_TOKENS_AVAILABLE,
    DUMMY,
    DUMMY_INT64,
    HANDLER_CLASS_NAME,
    KEY_ACTIVE_ADAPTER,
    KEY_ALLOC_TIMEOUT,
    KEY_ARGS_STRUCTURE,
    KEY_MAX_LENGTH,
    KEY_NEXT_SERVERS,
    KEY_OUTPUT_COMPRESSION,
    KEY_POINTS,
    KEY_PUSHED,
    KEY_SESSION_ID,
    KEY_START_FROM_POSITION,
    KEY_STEP_ID,
    ProtocolError,
    chain_uid,
    deserialize_tensors,
    dumps_metadata,
    is_dummy,
    loads_metadata,
    make_request,
    pack_args_kwargs,
    parse_chain,
    read_request,
    serialize_tensors,
    serialized_size,
    split_chain,
    stream_parts,
    unpack_args_kwargs,
)
from distconf.rpc.servicer import RPC_NAMES, BlockServicer

__all__ = [
    "CACHE_TOKENS_AVAILABLE", "DUMMY", "DUMMY_INT64", "HANDLER_CLASS_NAME", "KEY_ACTIVE_ADAPTER", "KEY_ALLOC_TIMEOUT",
    "KEY_ARGS_STRUCTURE", "KEY_MAX_LENGTH", "KEY_NEXT_SERVERS", "KEY_OUTPUT_COMPRESSION", "KEY_POINTS", "KEY_PUSHED",
    "KEY_SESSION_ID", "KEY_START_FROM_POSITION", "KEY_STEP_ID", "RPC_NAMES", "BlockServicer", "InferenceStream",
    "ProtocolError", "RpcLoop", "as_peer_id", "call_backward", "call_forward", "call_info", "call_push",
    "chain_uid", "deserialize_tensors", "dumps_metadata", "get_stub", "inference_step_request", "is_dummy",
    "loads_metadata", "make_request", "pack_args_kwargs", "parse_chain", "read_request", "serialize_tensors",
    "serialized_size", "split_chain", "stream_parts", "unpack_args_kwargs",
]
