"""``distconf serve`` through the Petals 2.x protocol: two real server processes on 127.0.0.1.

A minimal client made of the `distconf.rpc` helpers talks to them; every result is
compared with the local Hugging Face model (float32). Servers are shared by the module.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from blockhelpers import family_config, hf_model, record_layers, save_checkpoint
from dhthelpers import wait_for_async, wait_until
from swarm_harness import Swarm as HarnessSwarm

from distconf.tools.serving import ServerProcess, serve_command

pytestmark = pytest.mark.swarm

PREFIX = "test-serve-llama"
LAYERS = 4
CACHE_TOKENS = 128  # per block: 2 blocks x 128 tokens = the whole budget of a server
MAX_LENGTH = 64
STEP_TIMEOUT = 3.0
WAIT = 90.0  # bound on any startup wait


def start_server(args: list[str], log: Path) -> ServerProcess:
    """``distconf serve ARGS`` (the first one is the model folder), one compute thread."""
    return ServerProcess(serve_command(*args), log, env={"OMP_NUM_THREADS": "1"})


def wait_ready(server: ServerProcess) -> dict[str, Any]:
    return server.wait_ready(time.monotonic() + WAIT)


class Swarm(HarnessSwarm):
    """The harness's bootstrap DHT node (the client's node too), its RPC loop, two servers (blocks 0:2 and 2:4)
    and the local reference model."""

    def build(self) -> None:
        """The model folder; both servers start at once and join the bootstrap node."""
        from distconf.loader import load_family
        from distconf.rpc import RpcLoop

        _, hf_cfg, _ = family_config("llama", num_hidden_layers=LAYERS)
        self.local = hf_model(hf_cfg)
        self.model_dir = save_checkpoint(self.local, self.root / "model", shards=1)
        self.config = load_family("llama").from_pretrained(str(self.model_dir), dht_prefix=PREFIX)
        self.config.save_pretrained(self.model_dir)
        self.hidden = self.config.hidden_size
        self.client, self.initial_peers = self.dht, self.peers
        for name, blocks in (("a", "0:2"), ("b", "2:4")):
            self.add_server(start_server([*self.server_args(blocks), "--initial-peers", *self.initial_peers],
                                         self.root / f"server-{name}.log"))
        for server in self.servers:
            wait_ready(server)
        self.loop = RpcLoop(self.client)
        self.on_close(self.loop.shutdown)

    def server_args(self, blocks: str, *extra: str) -> list[str]:
        return [str(self.model_dir), "--blocks", blocks, "--dtype", "fp32", "--step-timeout", str(STEP_TIMEOUT),
                "--session-timeout", "60", "--attn-cache-tokens", str(CACHE_TOKENS), "--inference-max-length",
                str(MAX_LENGTH), "--update-period", "2", "--max-alloc-timeout", "5",
                # the tests' one client peer may hold the whole budget; with this tiny hidden size, a call just
                # above the unary payload limit carries more tokens than the default cap
                "--max-peer-cache-share", "1", "--max-forward-tokens", "65536", *extra]

    @property
    def a(self) -> str:
        return self.servers[0].peer_id

    @property
    def b(self) -> str:
        return self.servers[1].peer_id

    def run(self, coro: Any, timeout: float = 60.0) -> Any:
        return self.loop.run(coro, timeout=timeout)

    def reference(self, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(input, output) hidden states of every layer of the local model."""
        return record_layers(self.local, self.config, ids)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    s = Swarm(tmp_path_factory.mktemp("serve"))
    try:
        yield s
    finally:
        codes = s.close()
        assert codes == [0, 0], f"servers exited with {codes}; logs in {s.root}"


def uid(start: int, end: int) -> str:
    from distconf.rpc import chain_uid

    return chain_uid(PREFIX, start, end)


def ids_for(swarm: Swarm, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, swarm.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


class Session:
    """An in-test client session on one server: step() returns the output tensor."""

    def __init__(self, swarm: Swarm, peer: str, start: int, end: int, max_length: int = 16,
                 session_id: str | None = None) -> None:
        self.swarm, self.peer, self.uid = swarm, peer, uid(start, end)
        self.max_length = max_length
        self.session_id = session_id or str(uuid.uuid4())
        self.stream: Any = None
        self.steps = 0

    async def open(self) -> Session:
        from distconf.rpc import InferenceStream

        self.stream = await InferenceStream.open(self.swarm.loop.p2p, self.peer, timeout=10)
        return self

    def request(self, hidden: torch.Tensor, prompts: Any = None, hypo_ids: Any = None, **metadata: Any) -> Any:
        from distconf.rpc import inference_step_request

        meta = {"step_id": metadata.pop("step_id", str(uuid.uuid4())), **metadata}
        if self.steps == 0:
            meta.setdefault("max_length", self.max_length)
            meta.setdefault("session_id", self.session_id)
        self.steps += 1
        return inference_step_request(self.uid, hidden, prompts, hypo_ids, meta)

    async def step(self, hidden: torch.Tensor, prompts: Any = None, hypo_ids: Any = None,
                   **metadata: Any) -> torch.Tensor:
        from distconf.rpc import deserialize_tensors

        reply = await self.stream.step(self.request(hidden, prompts, hypo_ids, **metadata), timeout=20)
        return deserialize_tensors(reply.tensors)[0]

    async def close(self) -> None:
        await self.stream.close(timeout=5)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------ info and discovery


def test_rpc_info_reports_schemas_and_full_cache(swarm: Swarm) -> None:
    from distconf.rpc import CACHE_TOKENS_AVAILABLE, call_info

    info = swarm.run(call_info(swarm.loop.p2p, swarm.a, f"{PREFIX}.1", timeout=10))
    assert info[CACHE_TOKENS_AVAILABLE] == 2 * CACHE_TOKENS
    (hidden_descr, prompts_descr, hypo_descr), kwargs = info["inference_schema"]
    assert hidden_descr.dtype == prompts_descr.dtype == torch.float32 and hypo_descr.dtype == torch.int64
    assert kwargs == {}
    assert info["outputs_schema"][0].shape[-1] == swarm.hidden
    assert info["inference_max_length"] == MAX_LENGTH
    assert (info["start_block"], info["end_block"]) == (0, 2)


def test_ready_lines_describe_the_servers(swarm: Swarm) -> None:
    """Each server's ``DISTCONF_READY`` record names its peer, loopback addresses, blocks and prefix."""
    for server, blocks in zip(swarm.servers, ([0, 2], [2, 4]), strict=True):
        ready = server.ready
        assert ready is not None and ready["peer_id"] == server.peer_id
        assert ready["blocks"] == blocks and ready["dht_prefix"] == PREFIX
        assert ready["throughput"] > 0 and ready["parameters"] > 0
        assert ready["addresses"] and all(a.startswith("/ip4/127.0.0.1/") and a.endswith(server.peer_id)
                                          for a in ready["addresses"])


def test_servers_announce_online_with_throughput_and_cache(swarm: Swarm) -> None:
    from distconf.dht import ServerState, find_block_servers

    state = find_block_servers(swarm.client, swarm.config, timeout=10)
    spans = {s.peer_id: s for s in state.spans}
    assert {swarm.a, swarm.b} <= set(spans)
    for peer, (start, end) in ((swarm.a, (0, 2)), (swarm.b, (2, 4))):
        span = spans[peer]
        assert (span.start, span.end) == (start, end)
        assert span.state == ServerState.ONLINE
        assert span.info.throughput > 0 and span.info.torch_dtype == "float32"
        assert span.info.cache_tokens_left == 2 * 2 * CACHE_TOKENS  # Petals 2.x units: K and V halves


# ------------------------------------------------------------------ forward / backward


def test_forward_through_two_servers_equals_local_layers(swarm: Swarm) -> None:
    from distconf.rpc import call_forward

    ids = ids_for(swarm, 2, 9)
    ref = swarm.reference(ids)
    mid = swarm.run(call_forward(swarm.loop.p2p, swarm.a, uid(0, 2), ref[0][0], timeout=20))
    assert close(mid, ref[1][1])
    out = swarm.run(call_forward(swarm.loop.p2p, swarm.b, uid(2, 4), mid, timeout=20))
    assert close(out, ref[3][1])


def test_forward_stream_form_with_parts(swarm: Swarm) -> None:
    from hivemind.compression.serialization import deserialize_tensor_stream
    from hivemind.utils.asyncio import iter_as_aiter

    from distconf.rpc import dumps_metadata, get_stub, pack_args_kwargs, serialize_tensors, stream_parts

    ids = ids_for(swarm, 2, 6, seed=3)
    ref = swarm.reference(ids)
    flat, structure = pack_args_kwargs(ref[2][0], torch.empty(0))
    parts = list(stream_parts(uid(2, 4), serialize_tensors(flat), dumps_metadata({"args_structure": structure}),
                              chunk_size=1000))
    assert len(parts) > 3

    async def call() -> list[torch.Tensor]:
        replies = await get_stub(swarm.loop.p2p, swarm.b).rpc_forward_stream(iter_as_aiter(parts))
        return await deserialize_tensor_stream(msg.tensors async for msg in replies)

    (out,) = swarm.run(call())
    assert close(out, ref[3][1])


def test_calls_above_the_unary_limit_use_the_stream_form(swarm: Swarm) -> None:
    from distconf.rpc import call_backward, call_forward
    from distconf.rpc.protocol import MAX_UNARY_PAYLOAD_SIZE

    blocks = _local_blocks(swarm, 2, 4)
    g = torch.Generator().manual_seed(8)
    batch = MAX_UNARY_PAYLOAD_SIZE // (4 * 4 * swarm.hidden) + 1  # float32 [batch, 4, hidden] just over the limit
    x = torch.randn(batch, 4, swarm.hidden, generator=g)
    grad_out = torch.randn(batch, 4, swarm.hidden, generator=g)
    assert x.numel() * 4 > MAX_UNARY_PAYLOAD_SIZE
    xl = x.clone().requires_grad_(True)
    h = xl
    for block in blocks:
        h, _ = block(h)
    h.backward(grad_out)
    out = swarm.run(call_forward(swarm.loop.p2p, swarm.b, uid(2, 4), x, timeout=60), timeout=90)
    assert close(out, h.detach())
    (grad,) = swarm.run(call_backward(swarm.loop.p2p, swarm.b, uid(2, 4), x, grad_out, timeout=60), timeout=90)
    assert torch.allclose(grad, xl.grad, atol=1e-5)


def _local_blocks(swarm: Swarm, start: int, end: int) -> list[Any]:
    from distconf.blocks.weights import load_block

    return [load_block(swarm.model_dir, swarm.config, i, dtype=torch.float32) for i in range(start, end)]


def test_backward_gives_input_and_prompt_gradients(swarm: Swarm) -> None:
    from distconf.rpc import call_backward

    blocks = _local_blocks(swarm, 0, 2)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 5, swarm.hidden, generator=g)
    grad_out = torch.randn(2, 5, swarm.hidden, generator=g)
    prompts = torch.randn(2, 2, 3, swarm.hidden, generator=g) * 0.1
    xl, pl = x.clone().requires_grad_(True), prompts.clone().requires_grad_(True)
    h = xl
    for i, block in enumerate(blocks):
        h = torch.cat([h[:, :3] + pl[i], h[:, 3:]], dim=1)
        h, _ = block(h)
    h.backward(grad_out)
    grads = swarm.run(call_backward(swarm.loop.p2p, swarm.a, uid(0, 2), x, grad_out, prompts, timeout=20))
    assert len(grads) == 2
    assert torch.allclose(grads[0], xl.grad, atol=1e-5) and torch.allclose(grads[1], pl.grad, atol=1e-5)
    (only_inputs,) = swarm.run(call_backward(swarm.loop.p2p, swarm.a, uid(0, 2), x, grad_out, timeout=20))
    assert only_inputs.shape == x.shape and torch.isfinite(only_inputs).all()


def test_forward_with_deep_prompts(swarm: Swarm) -> None:
    from distconf.rpc import call_forward

    blocks = _local_blocks(swarm, 2, 4)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 6, swarm.hidden, generator=g)
    prompts = torch.randn(2, 1, 4, swarm.hidden, generator=g) * 0.1  # batch 1 broadcasts over the batch
    with torch.no_grad():
        h = x
        for i, block in enumerate(blocks):
            h = torch.cat([h[:, :4] + prompts[i], h[:, 4:]], dim=1)
            h, _ = block(h)
    out = swarm.run(call_forward(swarm.loop.p2p, swarm.b, uid(2, 4), x, prompts, timeout=20))
    assert close(out, h)

    async def session() -> torch.Tensor:  # inference applies prompts at absolute positions 0..3
        s = await Session(swarm, swarm.b, 2, 4).open()
        first = await s.step(x[:, :3], prompts)
        second = await s.step(x[:, 3:], prompts)
        await s.close()
        return torch.cat([first, second], dim=1)

    assert close(swarm.run(session()), h)


# ------------------------------------------------------------------ inference sessions


def test_inference_session_equals_local_model(swarm: Swarm) -> None:
    ids = ids_for(swarm, 2, 8, seed=1)
    ref = swarm.reference(ids)
    x = ref[0][0]

    async def run() -> torch.Tensor:
        a = await Session(swarm, swarm.a, 0, 2).open()
        b = await Session(swarm, swarm.b, 2, 4).open()
        outs = []
        for lo, hi in ((0, 4), (4, 5), (5, 6), (6, 8)):
            outs.append(await b.step(await a.step(x[:, lo:hi])))
        await a.close()
        await b.close()
        return torch.cat(outs, dim=1)

    assert close(swarm.run(run()), ref[3][1])


def test_rewind_with_start_from_position(swarm: Swarm) -> None:
    ids = ids_for(swarm, 2, 6, seed=2)
    ref = swarm.reference(ids)
    x, want = ref[2][0], ref[3][1]

    async def run() -> tuple[torch.Tensor, torch.Tensor]:
        s = await Session(swarm, swarm.b, 2, 4).open()
        first = await s.step(x[:, :3], start_from_position=0)
        await s.step(torch.randn(2, 2, swarm.hidden), start_from_position=3)  # a wrong branch ...
        again = await s.step(x[:, 3:], start_from_position=3)  # ... edited away
        await s.close()
        return first, again

    first, again = swarm.run(run())
    assert close(first, want[:, :3]) and close(again, want[:, 3:])


def test_hypo_ids_reorder_cache_rows(swarm: Swarm) -> None:
    ids = ids_for(swarm, 2, 6, seed=4)
    ref = swarm.reference(ids)
    x, want = ref[2][0], ref[3][1]
    swap = torch.tensor([1, 0])

    async def run() -> torch.Tensor:
        s = await Session(swarm, swarm.b, 2, 4).open()
        await s.step(x[:, :4])
        out = await s.step(x[swap, 4:], hypo_ids=swap)  # rows swapped, as beam search reorders hypotheses
        await s.close()
        return out

    assert close(swarm.run(run()), want[swap, 4:])


def test_push_between_servers(swarm: Swarm) -> None:
    ids = ids_for(swarm, 2, 7, seed=7)
    ref = swarm.reference(ids)
    x, want = ref[0][0], ref[3][1]

    async def run() -> list[torch.Tensor]:
        from distconf.rpc import deserialize_tensors

        a = await Session(swarm, swarm.a, 0, 2).open()
        b = await Session(swarm, swarm.b, 2, 4).open()
        outs = [await b.step(await a.step(x[:, :4]))]
        for t in range(4, 7):
            step_id = f"step-{t}"
            nxt = [(swarm.b, b.session_id, 2, 4)]
            await a.step(x[:, t:t + 1], step_id=step_id, next_servers=nxt)
            # b's reply comes from the push alone: the client has sent nothing to b for this step
            reply = await b.stream.receive(timeout=20)
            outs.append(deserialize_tensors(reply.tensors)[0])
            # the client's own copy of the step arrives late: b skips it (same step_id), no reply
            await b.stream.send(b.request(torch.zeros(2, 1, swarm.hidden), step_id=step_id))
        await a.close()
        await b.close()
        return outs

    from distconf.rpc import call_info

    stats_before = swarm.run(call_info(swarm.loop.p2p, swarm.b, timeout=10))["stats"]
    outs = swarm.run(run())
    assert close(torch.cat(outs, dim=1), want)
    stats = swarm.run(call_info(swarm.loop.p2p, swarm.b, timeout=10))["stats"]
    assert stats.get("pushed_steps", 0) - stats_before.get("pushed_steps", 0) == 3
    assert stats.get("duplicate_steps", 0) - stats_before.get("duplicate_steps", 0) == 3


def test_petals_client_message_layout(swarm: Swarm) -> None:
    """Steps laid out as a Petals 2.x client sends them: session metadata on the first step only,
    ``start_from_position`` on every step, the full history first, tensors cast per the server's
    ``inference_schema``, ``points`` and an empty ``active_adapter``."""
    from hivemind.compression.serialization import serialize_torch_tensor
    from hivemind.utils.tensor_descr import BatchTensorDescriptor

    from distconf.rpc import (
        DUMMY,
        DUMMY_INT64,
        InferenceStream,
        call_info,
        deserialize_tensors,
        dumps_metadata,
        make_request,
        pack_args_kwargs,
    )

    ids = ids_for(swarm, 1, 6, seed=9)
    ref = swarm.reference(ids)
    x, want = ref[0][0], ref[1][1]
    info = swarm.run(call_info(swarm.loop.p2p, swarm.a, f"{PREFIX}.0", timeout=10))
    compression = info["inference_schema"][0][0].compression
    session_metadata = {"max_length": 8, "points": 0.0, "active_adapter": "", "alloc_timeout": 10.0}

    async def run() -> torch.Tensor:
        stream = await InferenceStream.open(swarm.loop.p2p, swarm.a, timeout=10)
        outs, position = [], 0
        for chunk in (x[:, :4], x[:, 4:5], x[:, 5:6]):
            flat, structure = pack_args_kwargs(chunk, DUMMY, DUMMY_INT64)
            schema = [BatchTensorDescriptor.from_tensor(t, compression) for t in flat]
            metadata = {"session_id": "petals-layout", "step_id": str(uuid.uuid4()),
                        "start_from_position": position, "args_structure": structure}
            if position == 0:
                metadata.update(session_metadata)
            tensors = [serialize_torch_tensor(t.to(d.dtype), d.compression) for t, d in zip(flat, schema)]
            request = _with_metadata(make_request(uid(0, 2), tensors), dumps_metadata(metadata))
            reply = await stream.step(request, timeout=20)
            out = deserialize_tensors(reply.tensors)[0]
            assert out.shape == chunk.shape
            outs.append(out)
            position += chunk.shape[1]
        await stream.close(timeout=5)
        return torch.cat(outs, dim=1)

    assert close(swarm.run(run()), want)


def _with_metadata(request: Any, metadata: bytes) -> Any:
    request.metadata = metadata
    return request


# ------------------------------------------------------------------ bad requests and memory


def _forward_request(hidden: torch.Tensor, chain: str, metadata: bytes | None = None) -> Any:
    from distconf.rpc import dumps_metadata, make_request, pack_args_kwargs, serialize_tensors

    flat, structure = pack_args_kwargs(hidden, torch.empty(0))
    request = make_request(chain, serialize_tensors(flat))
    request.metadata = dumps_metadata({"args_structure": structure}) if metadata is None else metadata
    return request


def _step_request(hidden: torch.Tensor, chain: str | None = None, hypo_ids: Any = None, prompts: Any = None,
                  raw_metadata: bytes | None = None, **metadata: Any) -> Any:
    from distconf.rpc import inference_step_request

    request = inference_step_request(chain or uid(2, 4), hidden, prompts, hypo_ids, metadata)
    if raw_metadata is not None:
        request.metadata = raw_metadata
    return request


H = 64  # hidden size of the tiny llama (checked in the fixture-using tests below)


def _bad_forwards() -> dict[str, tuple[Any, str]]:
    from distconf.rpc import dumps_metadata

    x = torch.randn(2, 3, H)
    nan = x.clone()
    nan[1, 2, 5] = float("nan")
    return {
        "unknown uid": (_forward_request(x, f"{PREFIX}.0"), f"does not serve {PREFIX}.0"),
        "non-consecutive uids": (_forward_request(x, f"{PREFIX}.3 {PREFIX}.2"), "not consecutive"),
        "other model": (_forward_request(x, "other-model.2"), "does not serve other-model.2"),
        "no uid": (_forward_request(x, ""), "names no block uid"),
        "wrong rank": (_forward_request(x[0], uid(2, 4)), "3 dimensions"),
        "wrong dtype": (_forward_request(x.long(), uid(2, 4)), "floating-point"),
        "wrong hidden size": (_forward_request(torch.randn(2, 3, H + 1), uid(2, 4)), "hidden size"),
        "NaN values": (_forward_request(nan, uid(2, 4)), "NaN"),
        "malformed metadata": (_forward_request(x, uid(2, 4), b"\xc1\xc1 not msgpack"), "msgpack"),
        "bad args_structure": (_forward_request(x, uid(2, 4), b"\x81\xaeargs_structure\x91\xa4__T7"), "args_structure"),
        "unknown adapter": (_forward_request(x, uid(2, 4), dumps_metadata({"active_adapter": "lora-x"})),
                            "adapter 'lora-x' is not served"),
    }


def _bad_sessions() -> dict[str, tuple[list[Any], str]]:
    x = torch.randn(2, 3, H)
    return {
        "session longer than the server allows": ([_step_request(x, max_length=MAX_LENGTH + 1)], "out of range"),
        "no max_length": ([_step_request(x)], "must contain an integer 'max_length'"),
        "max_length not an integer": ([_step_request(x, max_length="12")], "must be an integer"),
        "steps beyond max_length": ([_step_request(x, max_length=4), _step_request(x)], "Maximum length exceeded"),
        "malformed metadata": ([_step_request(x, raw_metadata=b"\x93\x01\x02\x03")], "msgpack dict"),
        "unknown uid": ([_step_request(x, chain=uid(1, 3), max_length=8)], f"does not serve {PREFIX}.1"),
        "wrong hidden size": ([_step_request(torch.randn(2, 3, H - 1), max_length=8)], "hidden size"),
        "NaN values": ([_step_request(x * float("nan"), max_length=8)], "NaN"),
        "hypo_ids out of range": ([_step_request(x, max_length=8), _step_request(x, hypo_ids=torch.tensor([0, 2]))],
                                  "hypo_ids must be in"),
        "hypo_ids not int64": ([_step_request(x, max_length=8), _step_request(x, hypo_ids=torch.tensor([0., 1.]))],
                               "hypo_ids must be int64"),
        "batch changes": ([_step_request(x, max_length=8), _step_request(x[:1])], "opened with 2"),
        "rewind forward": ([_step_request(x, max_length=8), _step_request(x, start_from_position=5)], "out of range"),
        "prompts of the wrong shape": ([_step_request(x, max_length=8, prompts=torch.randn(3, 2, 1, H))],
                                       "prompts must have shape"),
        "unknown adapter": ([_step_request(x, max_length=8, active_adapter="lora-x")], "is not served"),
        "next_servers malformed": ([_step_request(x, max_length=8, next_servers=[["peer", 1]])], "next_servers"),
        "never fits the budget": ([_step_request(torch.randn(5, 1, H), max_length=MAX_LENGTH)],
                                  "whole cache budget"),
    }


async def _expect_stream_error(swarm: Swarm, messages: list[Any], timeout: float = 20.0) -> str:
    """Send ``messages`` on a new inference stream; the server's error text ("EOF without an error" if it ended
    the stream without one, "no error" if it answered them all).

    An end without an error is tried once more: under heavy load the server's error reply was seen lost once
    (1 of 16 cases of a CI run at load 5 on 2 cores), the stream ending as it was sent; a server that never says
    why still fails the test."""
    text = await _stream_error_once(swarm, messages, timeout)
    return await _stream_error_once(swarm, messages, timeout) if text == "EOF without an error" else text


async def _stream_error_once(swarm: Swarm, messages: list[Any], timeout: float) -> str:
    from hivemind.p2p import P2PHandlerError

    from distconf.rpc import InferenceStream

    stream = await InferenceStream.open(swarm.loop.p2p, swarm.b, timeout=10)
    try:
        for message in messages:
            await stream.send(message)
        for _ in range(len(messages) + 1):  # one reply per accepted step, then the error
            await stream.receive(timeout=timeout)
    except P2PHandlerError as exc:
        return str(exc)
    except EOFError:
        return "EOF without an error"
    finally:
        await stream.close(timeout=2)
    return "no error"


def _with_honest_session(swarm: Swarm, attempt: Any, seed: int = 11) -> str:
    """Run ``attempt()`` (returns an error text) between the steps of an honest session, which must still
    produce the local model's outputs."""
    ids = ids_for(swarm, 2, 6, seed=seed)
    ref = swarm.reference(ids)
    x, want = ref[2][0], ref[3][1]

    async def run() -> tuple[str, torch.Tensor]:
        honest = await Session(swarm, swarm.b, 2, 4).open()
        first = await honest.step(x[:, :3])
        task = asyncio.ensure_future(attempt())
        while not task.done():  # keep the honest session going meanwhile (0-token steps compute nothing)
            await asyncio.wait([task], timeout=STEP_TIMEOUT / 3)
            assert (await honest.step(x[:, :0])).shape == (2, 0, H)
        error = task.result()
        second = await honest.step(x[:, 3:])
        await honest.close()
        return error, torch.cat([first, second], dim=1)

    error, out = swarm.run(run(), timeout=90)
    assert close(out, want), "the honest session was disturbed"
    return error


@pytest.mark.parametrize("case", list(_bad_forwards()))
def test_bad_forward_gets_its_error_and_others_continue(swarm: Swarm, case: str) -> None:
    from hivemind.p2p import P2PHandlerError

    from distconf.rpc import get_stub

    assert swarm.hidden == H
    request, expected = _bad_forwards()[case]

    async def attempt() -> str:
        try:
            await get_stub(swarm.loop.p2p, swarm.b).rpc_forward(request, timeout=20)
        except P2PHandlerError as exc:
            return str(exc)
        return "no error"

    assert expected in _with_honest_session(swarm, attempt)


@pytest.mark.parametrize("case", list(_bad_sessions()))
def test_bad_session_gets_its_error_and_others_continue(swarm: Swarm, case: str) -> None:
    assert swarm.hidden == H
    messages, expected = _bad_sessions()[case]
    assert expected in _with_honest_session(swarm, lambda: _expect_stream_error(swarm, messages))


def test_refused_requests_are_one_log_line_each(swarm: Swarm) -> None:
    """hivemind's traceback for a refused request becomes one line with the reason (runs after the cases above)."""
    log = (swarm.root / "server-b.log").read_text(errors="replace")
    refused = [line for line in log.splitlines() if "refused a request: " in line]
    assert len(refused) >= len(_bad_sessions()), log[-3000:]  # unary refusals are not logged by hivemind at all
    assert any("is not served" in line for line in refused) and any("whole cache budget" in line for line in refused)
    assert "Traceback" not in log and "Handler failed with the exception" not in log


def test_silent_peer_times_out_and_frees_its_cache(swarm: Swarm) -> None:
    """A peer that opens a session and never sends, and one that allocates and then goes quiet."""

    async def attempt() -> str:
        silent = _expect_stream_error(swarm, [], timeout=STEP_TIMEOUT + 15)
        quiet = _expect_stream_error(swarm, [_step_request(torch.randn(2, 0, H), max_length=32)],
                                     timeout=STEP_TIMEOUT + 15)
        errors = await asyncio.gather(silent, quiet)
        return " | ".join(errors)

    error = _with_honest_session(swarm, attempt)
    assert error.count("step_timeout") == 2, error


def test_allocation_waits_alloc_timeout_then_fails(swarm: Swarm) -> None:
    """The honest session holds 64 of the 256 token-blocks, a holder 192: a third request waits, then fails."""
    from distconf.rpc import InferenceStream

    async def attempt() -> str:
        holder = await InferenceStream.open(swarm.loop.p2p, swarm.b, timeout=10)
        await holder.step(_step_request(torch.randn(2, 0, H), max_length=48), timeout=20)  # 0 tokens: allocates
        try:
            t0 = time.monotonic()
            error = await _expect_stream_error(swarm, [_step_request(torch.randn(1, 1, H), max_length=8,
                                                                     alloc_timeout=1.0)])
            assert time.monotonic() - t0 >= 0.9  # it waited for memory before giving up
        finally:
            await holder.close(timeout=5)
        return error

    assert "alloc_timeout=1" in _with_honest_session(swarm, attempt)


def test_cache_back_to_full_budget_after_sessions(swarm: Swarm) -> None:
    from distconf.rpc import CACHE_TOKENS_AVAILABLE, call_info

    left = wait_until(lambda: {p: swarm.run(call_info(swarm.loop.p2p, p, timeout=10))[CACHE_TOKENS_AVAILABLE]
                               for p in (swarm.a, swarm.b)},  # sessions release their cache when their streams end
                      lambda left: all(v == 2 * CACHE_TOKENS for v in left.values()), timeout=10, interval=0.1)
    assert left == {swarm.a: 2 * CACHE_TOKENS, swarm.b: 2 * CACHE_TOKENS}


# ------------------------------------------------------------------ placement, shutdown


def test_planned_server_takes_the_weakest_block_and_goes_offline_on_sigterm(swarm: Swarm) -> None:
    """A server without --blocks places itself with the planner's rule; SIGTERM announces OFFLINE, exit 0."""
    from distconf.dht import ServerState, find_block_servers
    from distconf.planning import choose_blocks

    before = find_block_servers(swarm.client, swarm.config, timeout=10)
    expected = choose_blocks(swarm.config, 1, before)
    args = [a for a in swarm.server_args("0:1") if a not in ("--blocks", "0:1")]
    args += ["--update-period", "30"]  # records live 60 s: the OFFLINE one outlives the process
    server = start_server([*args, "--num-blocks", "1", "--initial-peers", *swarm.initial_peers],
                          swarm.root / "server-c.log")
    try:
        ready = wait_ready(server)
        assert tuple(ready["blocks"]) == expected and ready["dht_prefix"] == PREFIX
        state = find_block_servers(swarm.client, swarm.config, timeout=10)
        (span,) = [s for s in state.spans if s.peer_id == server.peer_id]
        assert (span.start, span.end) == expected and span.state == ServerState.ONLINE
    finally:
        code = server.stop()
    assert code == 0
    spans = wait_until(lambda: [s for s in find_block_servers(swarm.client, swarm.config, timeout=10).spans
                                if s.peer_id == server.peer_id],
                       lambda spans: spans and spans[0].state == ServerState.OFFLINE, timeout=5, interval=0.1)
    assert spans and spans[0].state == ServerState.OFFLINE


def test_bad_push_does_not_end_the_session(swarm: Swarm) -> None:
    from distconf.rpc import call_info, call_push, inference_step_request

    ids = ids_for(swarm, 2, 6, seed=12)
    ref = swarm.reference(ids)
    x, want = ref[2][0], ref[3][1]
    before = swarm.run(call_info(swarm.loop.p2p, swarm.b, timeout=10))["stats"].get("bad_pushes", 0)

    async def run() -> torch.Tensor:
        s = await Session(swarm, swarm.b, 2, 4).open()
        first = await s.step(x[:, :3])
        for chain, hidden in ((uid(2, 4), torch.randn(2, 1, H + 3)), (uid(3, 4), torch.randn(2, 1, H))):
            bad = inference_step_request(chain, hidden, metadata={"session_id": s.session_id, "pushed": True,
                                                                  "step_id": "bad"})
            await call_push(swarm.loop.p2p, swarm.b, bad, timeout=10)

        async def both_counted() -> bool:  # the session takes pushes from its queue between steps
            stats = (await call_info(swarm.loop.p2p, swarm.b, timeout=10))["stats"]
            return stats.get("bad_pushes", 0) - before >= 2

        await wait_for_async(both_counted, timeout=5, interval=0.05)
        second = await s.step(x[:, 3:])
        await s.close()
        return torch.cat([first, second], dim=1)

    assert close(swarm.run(run()), want)
    after = swarm.run(call_info(swarm.loop.p2p, swarm.b, timeout=10))["stats"].get("bad_pushes", 0)
    assert after - before == 2
