"""The wire format shared by server and client: packing, uid chains, metadata, streaming, handler names."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.compression.serialization import deserialize_tensor_stream
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from distconf.rpc import (
    DUMMY,
    DUMMY_INT64,
    RPC_NAMES,
    BlockServicer,
    ProtocolError,
    chain_uid,
    deserialize_tensors,
    dumps_metadata,
    inference_step_request,
    is_dummy,
    loads_metadata,
    pack_args_kwargs,
    parse_chain,
    read_request,
    serialize_tensors,
    split_chain,
    stream_parts,
    unpack_args_kwargs,
)


def test_pack_args_kwargs_marks_tensors_as_petals_does() -> None:
    x, p = torch.randn(2, 3, 4), torch.randn(1, 2, 1, 4)
    flat, structure = pack_args_kwargs(x, p, DUMMY_INT64, flag=True)
    assert structure == ((b"__T0", b"__T1", b"__T2"), {"flag": True})
    assert flat[0] is x and flat[1] is p and flat[2] is DUMMY_INT64
    # the structure survives msgpack (it travels in the metadata)
    restored = MSGPackSerializer.loads(MSGPackSerializer.dumps({"args_structure": structure}))["args_structure"]
    args, kwargs = unpack_args_kwargs(flat, restored)
    assert args[0] is x and args[1] is p and kwargs == {"flag": True}


def test_pack_args_kwargs_sends_a_repeated_tensor_once() -> None:
    x = torch.randn(2)
    flat, structure = pack_args_kwargs(x, x)
    assert len(flat) == 1 and structure == ((b"__T0", b"__T0"), {})


def test_unpack_with_a_structure_that_does_not_match_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="args_structure"):
        unpack_args_kwargs([torch.zeros(1)], ((b"__T3",), {}))


def test_dummies_are_empty() -> None:
    assert is_dummy(DUMMY) and is_dummy(DUMMY_INT64) and DUMMY_INT64.dtype == torch.int64
    assert not is_dummy(torch.zeros(1))


def test_chain_uids() -> None:
    from distconf.loader import naming

    assert (chain_uid, split_chain) == (naming.chain_uid, naming.split_chain)  # one home: the loader's naming
    assert chain_uid("m", 2, 5) == "m.2 m.3 m.4" == naming.CHAIN_DELIMITER.join(naming.block_uids("m", 2, 5))
    assert chain_uid("m", 2, 2) == ""
    assert split_chain("m.2 m.3") == ["m.2", "m.3"] and split_chain("") == []
    assert split_chain(chain_uid("org/m", 0, 3)) == naming.block_uids("org/m", 0, 3)
    assert parse_chain("org-model.7 org-model.8") == ("org-model", [7, 8])
    with pytest.raises(ValueError, match="must not contain"):
        chain_uid("a b", 0, 1)


@pytest.mark.parametrize(("uids", "message"), [
    ("", "no block uid"), ("m.1 m.3", "not consecutive"), ("m.2 m.1", "not consecutive"),
    ("m.1 n.2", "two models"), ("m.x", "prefix.index"), ("m", "prefix.index"), (".3", "prefix.index"),
    ("m.-1", "prefix.index"), ("m.\u0661", "prefix.index"),
])
def test_bad_chains(uids: str, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        parse_chain(uids)


def test_metadata_roundtrip_and_errors() -> None:
    assert loads_metadata(dumps_metadata({"max_length": 8, "session_id": "s"})) == {"max_length": 8, "session_id": "s"}
    assert loads_metadata(b"") == {} and dumps_metadata(None) == b""
    with pytest.raises(ProtocolError, match="msgpack dict"):
        loads_metadata(MSGPackSerializer.dumps([1, 2]))
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        loads_metadata(b"\xc1")


def test_tensor_serialization_and_errors() -> None:
    x = torch.randn(2, 3, 4)
    (back,) = deserialize_tensors(serialize_tensors([x]))
    assert torch.equal(back, x)
    (half,) = deserialize_tensors(serialize_tensors([x], torch.bfloat16))
    assert half.dtype == torch.bfloat16
    (ids,) = deserialize_tensors(serialize_tensors([torch.tensor([1, 0])], torch.float16))
    assert ids.dtype == torch.int64  # only floating tensors are cast
    with pytest.raises(ProtocolError, match="tensor 0"):
        deserialize_tensors([runtime_pb2.Tensor(buffer=b"abc", size=[5], dtype="float32")])


def test_inference_step_request_layout() -> None:
    x, hypo = torch.randn(2, 1, 8), torch.tensor([1, 0])
    request = inference_step_request("m.0 m.1", x, None, hypo, {"step_id": "a"})
    tensors, metadata = read_request(request)
    assert request.uid == "m.0 m.1" and metadata["step_id"] == "a"
    args, _ = unpack_args_kwargs(tensors, metadata["args_structure"])
    assert torch.equal(args[0], x) and is_dummy(args[1]) and torch.equal(args[2], hypo)


def test_stream_parts_rejoin_to_the_same_tensors() -> None:
    tensors = [torch.randn(3, 100, 8), torch.arange(10)]
    parts = list(stream_parts("m.0", serialize_tensors(tensors), b"meta", chunk_size=512))
    assert len(parts) > 4 and all(p.uid == "m.0" and p.metadata == b"meta" for p in parts)

    async def join() -> list[torch.Tensor]:
        async def source():
            for p in parts:
                yield p.tensors
        return await deserialize_tensor_stream(source())

    back = asyncio.run(join())
    assert all(torch.equal(a, b) for a, b in zip(back, tensors))


def test_handlers_are_named_as_petals_names_them() -> None:
    BlockServicer._collect_rpc_handlers()
    names = {h.method_name: h for h in BlockServicer._rpc_handlers}
    assert set(names) == set(RPC_NAMES)
    assert BlockServicer._get_handle_name(None, "rpc_inference") == "TransformerConnectionHandler.rpc_inference"
    assert names["rpc_inference"].stream_input and names["rpc_inference"].stream_output
    assert names["rpc_forward_stream"].stream_input and not names["rpc_forward"].stream_input
    assert names["rpc_info"].request_type is runtime_pb2.ExpertUID

    class Renamed(BlockServicer):
        pass

    assert Renamed._get_handle_name(None, "rpc_push") == "TransformerConnectionHandler.rpc_push"
