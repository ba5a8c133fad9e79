"""Hostile callers against the server's runtime (issue 22, server side: stalls, amplification, sharing, hijacking).

The first part drives a real `BlockHandler` in-process (real tiny blocks, real sessions,
real compute thread): every case is refused for its caller only, from the headers and
lengths it announces, before anything large is decoded, with one error and no traceback;
the honest session next to it gives the same outputs and the budget is full afterwards.
The second part (``swarm``) rebuilds the issue's attacks against a real ``distconf serve``
process through `hostile_client` and checks the victim as the attack run did.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest
import torch
from dhthelpers import wait_for, wait_for_async
from handlerhelpers import PREFIX, Caller, make_handler, output, step, tiny_served
from hivemind.proto import runtime_pb2
from swarm_harness import Swarm as HarnessSwarm

from distconf.rpc import chain_uid, inference_step_request
from distconf.rpc.protocol import (
    KEY_MAX_LENGTH,
    KEY_NEXT_SERVERS,
    KEY_PUSH_FROM,
    KEY_PUSHED,
    KEY_SESSION_ID,
    KEY_STEP_ID,
    ProtocolError,
    loads_metadata,
    make_request,
    pack_args_kwargs,
    serialize_tensors,
    stream_parts,
)
from distconf.server.compute import ServedBlock, forward_chain
from distconf.server.inference import MAX_REMEMBERED_STEPS, StepIds
from distconf.server.session_cache import SessionCache
from distconf.server.validation import MAX_ID_CHARS, MAX_PEER_ID_CHARS, RequestError

H = 64
UPSTREAM, THIEF, CLIENT, OTHER = "QmUpstreamServer", "QmThiefPeer", "QmHonestClient", "QmOtherClient"


def peer(name: str) -> Any:
    """A caller's context as the handler sees it."""
    return SimpleNamespace(remote_id=name)


@pytest.fixture(scope="module")
def tiny_blocks() -> list[ServedBlock]:
    return tiny_served(2, H)


@pytest.fixture
def executor():
    with ThreadPoolExecutor(1) as pool:
        yield pool


def hidden_of(length: int, seed: int = 1, batch: int = 1) -> torch.Tensor:
    return torch.randn(batch, length, H, generator=torch.Generator().manual_seed(seed))


def forward_request(hidden: torch.Tensor, num_blocks: int = 2) -> runtime_pb2.ExpertRequest:
    flat, structure = pack_args_kwargs(hidden, torch.empty(0))
    return make_request(chain_uid(PREFIX, 0, num_blocks), serialize_tensors(flat), {"args_structure": structure})


def forged(request: runtime_pb2.ExpertRequest, index: int = 0, **header: Any) -> runtime_pb2.ExpertRequest:
    """``request`` with tensor ``index``'s header fields replaced (``size``, ``dtype``, ``buffer``)."""
    tensor = request.tensors[index]
    if "size" in header:
        del tensor.size[:]
        tensor.size.extend(header.pop("size"))
    for key, value in header.items():
        setattr(tensor, key, value)
    return request


def run(coro: Any, timeout: float = 60) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def honest_session(handler: Any, tiny_blocks: list[ServedBlock]) -> None:
    """An honest 2-step session next to the attack: the same outputs as the blocks computed locally."""
    caller = Caller(handler, peer(OTHER))
    x = hidden_of(3, seed=5)
    first = await asyncio.wait_for(caller.send(step(x[:, :2], **{KEY_MAX_LENGTH: 8, KEY_STEP_ID: "h1"})), 20)
    second = await asyncio.wait_for(caller.send(step(x[:, 2:], **{KEY_STEP_ID: "h2"})), 20)
    reference = forward_chain(tiny_blocks, x, [None, None])
    assert torch.allclose(torch.cat([output(first), output(second)], dim=1), reference, atol=1e-5)
    await caller.close()


# ------------------------------------------------------------------ stalls


@pytest.mark.parametrize("peer_id", ["1" * 80_000, "12D3KooW" + "0OIl" * 4, ""])
def test_a_huge_or_foreign_peer_id_in_next_servers_is_refused_before_it_is_decoded(
        tiny_blocks: list[ServedBlock], executor: ThreadPoolExecutor, peer_id: str) -> None:
    async def scenario() -> None:
        handler = make_handler(tiny_blocks, executor, 4 * SessionCache.nbytes(tiny_blocks, 1, 8))
        caller = Caller(handler, peer(CLIENT))
        await asyncio.wait_for(caller.send(step(hidden_of(1), **{KEY_MAX_LENGTH: 8})), 20)
        bad = step(hidden_of(1), **{KEY_NEXT_SERVERS: [[peer_id, "s", 2, 4]]})
        with pytest.raises(RequestError, match=f"base58 peer id of at most {MAX_PEER_ID_CHARS} characters"):
            await asyncio.wait_for(caller.send(bad), 20)
        assert handler.stats["pushes_sent"] == 0
        await honest_session(handler, tiny_blocks)
        assert handler.budget.bytes_left == handler.budget.total_bytes

    run(scenario())


def test_a_forward_over_the_token_cap_is_refused_from_its_header(tiny_blocks: list[ServedBlock],
                                                                  executor: ThreadPoolExecutor) -> None:
    async def scenario() -> None:
        handler = make_handler(tiny_blocks, executor, SessionCache.nbytes(tiny_blocks, 1, 8), max_forward_tokens=16)
        ok = await handler.rpc_forward(forward_request(hidden_of(16)), peer(CLIENT))
        assert len(ok.tensors) == 1
        with pytest.raises(RequestError, match="1 x 17 tokens exceeds the 16 tokens"):
            await handler.rpc_forward(forward_request(hidden_of(17)), peer(CLIENT))
        # a header announcing 55,000 tokens with no buffer: refused for its size, nothing decoded
        huge = forged(forward_request(hidden_of(1)), size=[1, 55_000, H], buffer=b"")
        with pytest.raises(RequestError, match="1 x 55000 tokens exceeds"):
            await handler.rpc_forward(huge, peer(CLIENT))
        with pytest.raises(RequestError, match="2 x 9 tokens exceeds"):
            await handler.rpc_backward(forward_request(hidden_of(9, batch=2)), peer(CLIENT))
        # the stream form: refused at the first part's header
        (big,) = serialize_tensors([hidden_of(40)])
        parts = stream_parts(chain_uid(PREFIX, 0, 2), [big], chunk_size=1024)

        async def requests() -> Any:
            for part in parts:
                yield part

        with pytest.raises(RequestError, match="1 x 40 tokens exceeds"):
            async for _ in handler.rpc_forward_stream(requests(), peer(CLIENT)):
                pass
        assert handler.stats["forward"] == 1 and handler.compute.stats["training"] == 1

    run(scenario())


def test_a_forward_past_its_deadline_is_refused_in_one_line_and_never_computed(
        tiny_blocks: list[ServedBlock], executor: ThreadPoolExecutor, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        handler = make_handler(tiny_blocks, executor, SessionCache.nbytes(tiny_blocks, 1, 8), request_timeout=0.2)
        started, release = threading.Event(), threading.Event()

        def hold() -> None:
            started.set()
            release.wait(30)

        busy = asyncio.ensure_future(handler.compute.run(hold))  # the compute thread is taken
        await wait_for_async(started.is_set, timeout=10, interval=0.01)
        try:
            with pytest.raises(RequestError, match=r"rpc_forward exceeded request_timeout=0\.2 s"):
                await handler.rpc_forward(forward_request(hidden_of(4)), peer(CLIENT))
        finally:
            release.set()
        await busy
        # the honest forward after it only has to finish: 0.2 s failed once on a starved CI machine
        handler.settings.request_timeout = 60.0
        ok = await handler.rpc_forward(forward_request(hidden_of(2)), peer(OTHER))
        assert len(ok.tensors) == 1
        assert handler.compute.stats["training"] == 1  # the timed-out forward was dropped before it started

    run(scenario())
    assert not [r for r in caplog.records if r.exc_info]


# ------------------------------------------------------------------ memory and log amplification


def test_a_long_step_id_is_refused_and_step_ids_are_kept_as_digests(tiny_blocks: list[ServedBlock],
                                                                    executor: ThreadPoolExecutor) -> None:
    async def scenario() -> None:
        handler = make_handler(tiny_blocks, executor, SessionCache.nbytes(tiny_blocks, 1, 8))
        caller = Caller(handler, peer(CLIENT))
        await asyncio.wait_for(caller.send(step(hidden_of(1), **{KEY_MAX_LENGTH: 8})), 20)
        with pytest.raises(RequestError, match=f"at most {MAX_ID_CHARS} are accepted"):
            await asyncio.wait_for(caller.send(step(hidden_of(0), **{KEY_STEP_ID: "x" * 2**20})), 20)
        await honest_session(handler, tiny_blocks)
        assert handler.budget.bytes_left == handler.budget.total_bytes

    run(scenario())
    ids = StepIds()
    for i in range(3 * MAX_REMEMBERED_STEPS):
        ids.add(f"{i:0{MAX_ID_CHARS}d}")
    assert len(ids._seen) == MAX_REMEMBERED_STEPS and all(len(k) == 16 for k in ids._seen)
    assert f"{3 * MAX_REMEMBERED_STEPS - 1:0{MAX_ID_CHARS}d}" in ids and f"{0:0{MAX_ID_CHARS}d}" not in ids
    assert "1" not in ids and b"1" not in ids and 1 not in ids
    ids.add(b"1")
    assert b"1" in ids and "1" not in ids and 1 not in ids


def test_unknown_msgpack_ext_values_are_one_refusal_not_a_warning_each(
        tiny_blocks: list[ServedBlock], executor: ThreadPoolExecutor, caplog: pytest.LogCaptureFixture) -> None:
    raw = msgpack.packb({"args_structure": [msgpack.ExtType(99, b"x")] * 100_000}, use_bin_type=True)
    with caplog.at_level(logging.WARNING):
        with pytest.raises(ProtocolError, match="100000 msgpack ext values of unknown types"):
            loads_metadata(raw)
        request = forward_request(hidden_of(2))
        request.metadata = raw

        async def scenario() -> None:
            handler = make_handler(tiny_blocks, executor, SessionCache.nbytes(tiny_blocks, 1, 8))
            with pytest.raises(RequestError, match="unknown types"):
                await handler.rpc_forward(request, peer(CLIENT))
            await honest_session(handler, tiny_blocks)

        run(scenario())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_an_inference_step_larger_than_its_session_is_refused_before_decoding(
        tiny_blocks: list[ServedBlock], executor: ThreadPoolExecutor) -> None:
    async def scenario() -> None:
        handler = make_handler(tiny_blocks, executor, 4 * SessionCache.nbytes(tiny_blocks, 1, 8))
        # a first message announcing 64 MiB of hidden states for a session of max length 8
        caller = Caller(handler, peer(CLIENT))
        opening = forged(step(hidden_of(1), **{KEY_MAX_LENGTH: 8}), size=[1, 262_144, H], buffer=b"")
        with pytest.raises(RequestError, match="inference step of 1 x 262144 tokens exceeds"):
            await asyncio.wait_for(caller.send(opening), 20)
        # a later step of an open session
        caller = Caller(handler, peer(CLIENT))
        await asyncio.wait_for(caller.send(step(hidden_of(2), **{KEY_MAX_LENGTH: 8})), 20)
        with pytest.raises(RequestError, match="inference step of 1 x 9 tokens exceeds the 8 tokens"):
            await asyncio.wait_for(caller.send(step(hidden_of(9))), 20)
        await honest_session(handler, tiny_blocks)
        assert handler.budget.bytes_left == handler.budget.total_bytes

    run(scenario())


@pytest.mark.parametrize(("header", "match"), [
    ({"dtype": "complex128"}, "dtype 'complex128'"),
    ({"dtype": "float16"}, "needs 512 bytes, its buffer has 1024"),
    ({"buffer": b"\0" * (16 * 2**20)}, "needs 1024 bytes, its buffer has 16777216"),
    ({"size": [1, 4, H, 1, 1, 1, 1, 1, 1]}, "at most 8 dimensions"),
])
def test_dtypes_and_buffer_sizes_are_checked_from_the_header(tiny_blocks: list[ServedBlock],
                                                             executor: ThreadPoolExecutor,
                                                             header: dict[str, Any], match: str) -> None:
    async def scenario() -> None:
        handler = make_handler(tiny_blocks, executor, 4 * SessionCache.nbytes(tiny_blocks, 1, 8))
        with pytest.raises(RequestError, match=match):
            await handler.rpc_forward(forged(forward_request(hidden_of(4)), **header), peer(CLIENT))
        caller = Caller(handler, peer(CLIENT))
        with pytest.raises(RequestError, match=match):
            await asyncio.wait_for(caller.send(forged(step(hidden_of(4), **{KEY_MAX_LENGTH: 8}), **header)), 20)
        await honest_session(handler, tiny_blocks)
        assert handler.budget.bytes_left == handler.budget.total_bytes

    run(scenario())


# ------------------------------------------------------------------ sharing and hijacking


def test_one_peer_holds_at_most_its_share_of_the_cache(tiny_blocks: list[ServedBlock],
                                                        executor: ThreadPoolExecutor) -> None:
    unit = SessionCache.nbytes(tiny_blocks, 1, 8)

    async def scenario() -> None:
        handler = make_handler(tiny_blocks, executor, 4 * unit, max_peer_cache_share=0.5)
        hog = [Caller(handler, peer(THIEF)) for _ in range(2)]
        for caller in hog:
            await asyncio.wait_for(caller.send(step(hidden_of(1), **{KEY_MAX_LENGTH: 8})), 20)
        third = Caller(handler, peer(THIEF))
        with pytest.raises(RequestError, match=r"pass its share of \d+ bytes \(50% of the server's budget\)"):
            await asyncio.wait_for(third.send(step(hidden_of(1), **{KEY_MAX_LENGTH: 8})), 20)
        for _ in range(3):  # the hog keeps its sessions alive with empty steps: others are still tiny_blocks
            for caller in hog:
                await asyncio.wait_for(caller.send(step(hidden_of(0))), 20)
        await honest_session(handler, tiny_blocks)
        assert handler.budget.bytes_left == 2 * unit
        for caller in hog:
            await caller.close()
        assert handler.budget.bytes_left == 4 * unit and not handler.sessions._held

    run(scenario())


def _push(x: torch.Tensor, step_id: str, session_id: str = "victim") -> runtime_pb2.ExpertRequest:
    return step(x, **{KEY_SESSION_ID: session_id, KEY_PUSHED: True, KEY_STEP_ID: step_id})


@pytest.mark.parametrize("named", [True, False])
def test_pushes_are_taken_from_the_named_or_first_upstream_only(tiny_blocks: list[ServedBlock],
                                                                executor: ThreadPoolExecutor, named: bool) -> None:
    """A third peer that learned the session id cannot push a step into it; the honest outputs stay."""

    async def scenario() -> None:
        handler = make_handler(tiny_blocks, executor, 4 * SessionCache.nbytes(tiny_blocks, 1, 16))
        x = hidden_of(4, seed=3)
        caller = Caller(handler, peer(CLIENT))
        opening = {KEY_MAX_LENGTH: 16, KEY_SESSION_ID: "victim", KEY_STEP_ID: "s1",
                   **({KEY_PUSH_FROM: UPSTREAM} if named else {})}
        first = await asyncio.wait_for(caller.send(step(x[:, :2], **opening)), 20)
        if not named:  # a client naming no upstream (Petals 2.x): the first pusher is the upstream
            await handler.rpc_push(_push(x[:, 2:3], "s2"), peer(UPSTREAM))
            pushed = await asyncio.wait_for(caller.replies.__anext__(), 20)
            caller.messages.put_nowait(step(x[:, 2:3], **{KEY_STEP_ID: "s2"}))  # its own copy: a duplicate
        with pytest.raises(RequestError, match="takes pushes from another peer only"):
            await handler.rpc_push(_push(hidden_of(1, seed=9), "evil"), peer(THIEF))
        assert handler.stats["refused_pushes"] == 1
        if named:
            await handler.rpc_push(_push(x[:, 2:3], "s2"), peer(UPSTREAM))
            pushed = await asyncio.wait_for(caller.replies.__anext__(), 20)
            caller.messages.put_nowait(step(x[:, 2:3], **{KEY_STEP_ID: "s2"}))
        last = await asyncio.wait_for(caller.send(step(x[:, 3:], **{KEY_STEP_ID: "s3"})), 20)
        got = torch.cat([output(first), output(pushed), output(last)], dim=1)
        assert torch.allclose(got, forward_chain(tiny_blocks, x, [None, None]), atol=1e-5)
        assert handler.stats["pushed_steps"] == 1 and handler.stats["duplicate_steps"] == 1
        await caller.close()
        assert handler.budget.bytes_left == handler.budget.total_bytes

    run(scenario())


def test_a_client_naming_no_pusher_takes_no_push(tiny_blocks: list[ServedBlock], executor: ThreadPoolExecutor) -> None:
    async def scenario() -> None:
        handler = make_handler(tiny_blocks, executor, 4 * SessionCache.nbytes(tiny_blocks, 1, 16))
        caller = Caller(handler, peer(CLIENT))
        await asyncio.wait_for(caller.send(step(hidden_of(2), **{KEY_MAX_LENGTH: 16, KEY_SESSION_ID: "victim",
                                                                 KEY_PUSH_FROM: ""})), 20)
        for sender in (UPSTREAM, THIEF):
            with pytest.raises(RequestError, match="takes pushes from another peer only"):
                await handler.rpc_push(_push(hidden_of(1), f"from-{sender}"), peer(sender))
        # the client names its upstream later (its chain changed): that peer's pushes are taken from then on
        await asyncio.wait_for(caller.send(step(hidden_of(1), **{KEY_PUSH_FROM: UPSTREAM})), 20)
        await handler.rpc_push(_push(hidden_of(1), "p1"), peer(UPSTREAM))
        assert handler.stats["pushes_received"] == 1
        await asyncio.wait_for(caller.replies.__anext__(), 20)
        with pytest.raises(RequestError, match="base58 peer id"):
            await asyncio.wait_for(caller.send(step(hidden_of(1), **{KEY_PUSH_FROM: "x" * 200})), 20)

    run(scenario())


def test_a_pushed_message_cannot_rename_the_pusher(tiny_blocks: list[ServedBlock],
                                                   executor: ThreadPoolExecutor) -> None:
    """``push_from`` counts from the session's own client only: a push carries its upstream's metadata."""

    async def scenario() -> None:
        handler = make_handler(tiny_blocks, executor, 4 * SessionCache.nbytes(tiny_blocks, 1, 16))
        caller = Caller(handler, peer(CLIENT))
        await asyncio.wait_for(caller.send(step(hidden_of(2), **{KEY_MAX_LENGTH: 16, KEY_SESSION_ID: "victim",
                                                                 KEY_PUSH_FROM: UPSTREAM})), 20)
        renaming = step(hidden_of(1), **{KEY_SESSION_ID: "victim", KEY_PUSHED: True, KEY_PUSH_FROM: THIEF})
        await handler.rpc_push(renaming, peer(UPSTREAM))
        await asyncio.wait_for(caller.replies.__anext__(), 20)
        with pytest.raises(RequestError, match="takes pushes from another peer only"):
            await handler.rpc_push(_push(hidden_of(1), "evil"), peer(THIEF))

    run(scenario())


def test_inference_step_request_still_fits_the_budget_of_a_full_session(tiny_blocks: list[ServedBlock],
                                                                       executor: ThreadPoolExecutor) -> None:
    """The step caps leave room for what an honest client sends: a prefill of max_length, batch 2, prompts."""

    async def scenario() -> None:
        handler = make_handler(tiny_blocks, executor, 4 * SessionCache.nbytes(tiny_blocks, 2, 8))
        caller = Caller(handler, peer(CLIENT))
        prompts = torch.randn(2, 2, 8, H, generator=torch.Generator().manual_seed(2))
        x = hidden_of(8, batch=2)
        request = inference_step_request(chain_uid(PREFIX, 0, 2), x, prompts, metadata={KEY_MAX_LENGTH: 8})
        reply = await asyncio.wait_for(caller.send(request), 20)
        assert output(reply).shape == (2, 8, H)
        await caller.close()

    run(scenario())


# ------------------------------------------------------------------ against a real `distconf serve` (swarm)

CACHE_TOKENS = 512  # per block; the victim serves 2 blocks
MAX_LENGTH = 64
SERVE_FLAGS = ("--step-timeout", "4", "--request-timeout", "6", "--attn-cache-tokens", str(CACHE_TOKENS),
               "--inference-max-length", str(MAX_LENGTH), "--max-alloc-timeout", "2", "--balance-quality", "0")


class Swarm(HarnessSwarm):
    """A victim ``distconf serve`` (tiny model, blocks 0:2) and three peers: its honest client, an honest
    upstream server stand-in and a thief, each with a DHT node (a peer id) of its own."""

    def build(self) -> None:
        from hostile_client import HostileClient, Victim

        nodes = [self.dht, self.node(), self.node()]
        model_dir, _ = self.add_model("llama", "model", layers=2)
        self.server = self.start_server(model_dir, "0:2", *SERVE_FLAGS, log="victim.log")
        record = self.server.wait_ready(time_limit())
        self.client, self.upstream, self.thief = (HostileClient(node) for node in nodes)
        for client in (self.thief, self.upstream, self.client):
            self.on_close(client.shutdown)
        self.prefix = record["dht_prefix"]
        self.uid = chain_uid(self.prefix, 0, 2)
        hidden = int(self.client.info(self.server.peer_id)["hidden_size"])
        self.victim = Victim(self.server, self.client, self.uid, hidden)

    def close(self) -> list[int]:
        codes = super().close()
        assert codes == [0], self.server.log_tail()
        return codes

    def check(self, mark: int, *, max_lines: int = 12) -> None:
        """The victim after a case: alive, honest callers unaffected, budget full, no traceback, no flood."""
        assert self.victim.unaffected() == []
        log = self.victim.log_since(mark)
        assert "Traceback" not in log, log[-3000:]
        assert len(log.splitlines()) <= max_lines, log[-3000:]


def time_limit(seconds: float = 180.0) -> float:
    import time

    return time.monotonic() + seconds


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    s = Swarm(tmp_path_factory.mktemp("hostile-runtime"))
    try:
        yield s
    finally:
        s.close()


def _step_message(swarm: Swarm, hidden: torch.Tensor, **metadata: Any) -> runtime_pb2.ExpertRequest:
    return inference_step_request(swarm.uid, hidden, metadata=metadata)


def _refused(outcome: tuple[str, Any], match: str) -> None:
    kind, text = outcome
    assert kind == "refused" and match in str(text), outcome


@pytest.mark.swarm
@pytest.mark.parametrize("length", [80_000, 3 * 2**19])
def test_swarm_a_huge_peer_id_is_refused_and_rpc_info_still_answers(swarm: Swarm, length: int) -> None:
    v = swarm.victim
    mark = v.log_mark()
    session = _OpenSession(swarm, swarm.thief)
    try:
        session.step(v.hidden(1, 1), max_length=8, step_id="a")
        with pytest.raises(Exception, match="base58 peer id of at most 128 characters"):
            session.step(v.hidden(1, 2), step_id="b", next_servers=[["1" * length, "s", 2, 4]])
    finally:
        session.close()
    assert swarm.thief.info(v.peer)["hidden_size"] == v.hidden_size
    swarm.check(mark)


@pytest.mark.swarm
def test_swarm_a_55k_token_forward_is_refused_before_it_is_decoded(swarm: Swarm) -> None:
    from distconf.rpc import call_forward
    from distconf.server.settings import MIN_FORWARD_TOKENS

    v = swarm.victim
    mark, rss = v.log_mark(), v.rss_mib()
    x = v.hidden(55_000, 4)
    outcome = swarm.thief.outcome(call_forward(swarm.thief.loop.p2p, v.peer, swarm.uid, x, timeout=20), 20)
    # refused at the first part's header: the caller, still sending, may see its stream reset instead
    assert outcome[0] == "refused", outcome
    swarm.check(mark)
    # the default: Petals' max_batch_size for the model, or less where the server measured itself slow at start
    cap = swarm.client.info(v.peer)["max_forward_tokens"]
    logged = wait_for(lambda: f"1 x 55000 tokens exceeds the {cap} tokens" in v.log_since(mark), timeout=15)
    assert MIN_FORWARD_TOKENS <= cap <= 8192 and logged, v.log_since(mark)
    print(f"RSS {rss:.0f} -> {v.rss_mib():.0f} MiB")  # a figure for the report, not asserted


@pytest.mark.swarm
def test_swarm_100k_unknown_ext_values_give_one_line(swarm: Swarm) -> None:
    from hostile_client import raw_request

    v = swarm.victim
    mark = v.log_mark()
    metadata = msgpack.packb({"junk": [msgpack.ExtType(99, b"")] * 100_000}, use_bin_type=True)
    _refused(swarm.thief.forward(v.peer, raw_request(swarm.uid, [v.hidden(2, 5)], metadata)), "unknown types")
    swarm.check(mark, max_lines=4)


@pytest.mark.swarm
def test_swarm_oversized_and_mistyped_steps_are_refused_before_decoding(swarm: Swarm) -> None:
    v = swarm.victim
    mark, rss = v.log_mark(), v.rss_mib()
    # 64 MiB for a session of max length 8, and 16 MiB of float16 said to be complex128: refused from the
    # message's length, before it is read (the caller sees its stream end)
    for buffer, dtype, itemsize in ((2**26, "float32", 4), (2**24, "complex128", 16)):
        message = forged(_step_message(swarm, v.hidden(1, 6), max_length=8), buffer=b"\0" * buffer, dtype=dtype,
                         size=[1, buffer // itemsize // v.hidden_size, v.hidden_size])
        assert swarm.thief.inference(v.peer, [message])[0] == "refused"
    # the server logs a refusal as it drops the stream, which may be just after the caller saw the end
    log = wait_for(lambda: (text := v.log_since(mark)).count("a streamed message of") == 2 and text, timeout=15)
    log = log or v.log_since(mark)
    assert log.count("a streamed message of") == 2 and "exceeds this server's limit of" in log, log
    # within the message limit: from the tensors' headers
    complex_ = forged(_step_message(swarm, v.hidden(8, 7), max_length=8), dtype="complex128",
                      buffer=b"\0" * (8 * v.hidden_size * 16))
    _refused(swarm.thief.inference(v.peer, [complex_]), "dtype 'complex128'")
    over = _step_message(swarm, v.hidden(9, 7), max_length=8)
    _refused(swarm.thief.inference(v.peer, [over]), "1 x 9 tokens exceeds the 8 tokens")
    long_id = _step_message(swarm, v.hidden(1, 8), max_length=8, step_id="x" * 2**20)
    _refused(swarm.thief.inference(v.peer, [long_id]), "at most 256 are accepted")
    swarm.check(mark, max_lines=16)
    print(f"RSS {rss:.0f} -> {v.rss_mib():.0f} MiB")  # a figure for the report, not asserted


class _OpenSession:
    """An inference stream kept open on the victim from one peer's loop."""

    def __init__(self, swarm: Swarm, who: Any) -> None:
        from distconf.rpc import InferenceStream

        self.swarm, self.who = swarm, who
        self.stream = who.run(InferenceStream.open(who.loop.p2p, swarm.server.peer_id, timeout=20))

    def step(self, hidden: torch.Tensor, **metadata: Any) -> torch.Tensor:
        from distconf.rpc import deserialize_tensors

        reply = self.who.run(self.stream.step(_step_message(self.swarm, hidden, **metadata), timeout=20))
        return deserialize_tensors(reply.tensors)[0]

    def receive(self) -> torch.Tensor:
        from distconf.rpc import deserialize_tensors

        return deserialize_tensors(self.who.run(self.stream.receive(timeout=20)).tensors)[0]

    def send(self, hidden: torch.Tensor, **metadata: Any) -> None:
        self.who.run(self.stream.send(_step_message(self.swarm, hidden, **metadata)))

    def close(self) -> None:
        self.who.run(self.stream.close(timeout=5))


@pytest.mark.swarm
def test_swarm_a_peer_holding_its_share_does_not_lock_others_out(swarm: Swarm) -> None:
    v = swarm.victim
    mark = v.log_mark()
    full = v.cache_tokens()
    per_session = 2 * MAX_LENGTH  # cache tokens of one block a session of 2 blocks x MAX_LENGTH takes
    allowed = (full // 2) // per_session  # the thief's half of the budget
    hog = [_OpenSession(swarm, swarm.thief) for _ in range(allowed + 1)]
    try:
        for session in hog[:allowed]:
            session.step(v.hidden(1, 9), max_length=MAX_LENGTH)
        with pytest.raises(Exception, match="50% of the server's budget"):
            hog[allowed].step(v.hidden(1, 9), max_length=MAX_LENGTH)
        for _ in range(2):  # kept alive with empty steps, under the step timeout
            for session in hog[:allowed]:
                session.step(v.hidden(0, 9))
        assert v.cache_tokens() == full - allowed * per_session >= full // 2
        assert v.honest_outputs().keys() == v.reference.keys()  # an honest caller is still served
    finally:
        for session in hog[:allowed]:
            session.close()
    swarm.check(mark, max_lines=30)


@pytest.mark.swarm
def test_swarm_a_third_peer_cannot_push_into_a_session(swarm: Swarm) -> None:
    from distconf.rpc.protocol import make_request

    v = swarm.victim
    x = v.hidden(4, 10)

    def run_session(attack: bool) -> tuple[torch.Tensor, list[tuple[str, Any]]]:
        session_id = f"victim-{attack}"
        session = _OpenSession(swarm, swarm.client)
        outcomes = []
        try:
            upstream = str(swarm.upstream.loop.p2p.peer_id)
            first = session.step(x[:, :2], max_length=16, session_id=session_id, step_id="s1", push_from=upstream)
            pushed = _step_message(swarm, x[:, 2:3], session_id=session_id, step_id="s2", pushed=True)
            outcomes.append(swarm.upstream.push(v.peer, pushed))
            second = session.receive()  # the pushed step's reply
            session.send(x[:, 2:3], step_id="s2")  # the client's own copy: a duplicate, no reply
            if attack:
                evil = make_request(swarm.uid, serialize_tensors([v.hidden(1, 99)]),
                                    {KEY_SESSION_ID: session_id, KEY_PUSHED: True, KEY_STEP_ID: "evil"})
                outcomes.append(swarm.thief.push(v.peer, evil))
            third = session.step(x[:, 3:], step_id="s3")
        finally:
            session.close()
        return torch.cat([first, second, third], dim=1), outcomes

    reference, outcomes = run_session(attack=False)
    assert outcomes[0][0] == "ok"
    mark = v.log_mark()
    attacked, outcomes = run_session(attack=True)
    assert outcomes[0][0] == "ok"
    _refused(outcomes[1], "takes pushes from another peer only")
    assert torch.equal(attacked, reference)
    swarm.check(mark)


def test_the_default_forward_cap_is_what_the_server_computes_in_half_its_timeout() -> None:
    from distconf.server.settings import MIN_FORWARD_TOKENS, default_forward_tokens

    assert default_forward_tokens(8192, 0.0, 180, 4) == 8192  # not measured: Petals' max_batch_size
    assert default_forward_tokens(8192, 1e6, 180, 4) == 8192
    assert default_forward_tokens(8192, 1000.0, 6, 4) == 750  # 4 blocks x 750 tokens at 1000/s: 3 s of 6
    assert default_forward_tokens(2048, 10.0, 6, 30) == MIN_FORWARD_TOKENS


def test_sessions_of_no_cache_count_against_the_peer_share(tiny_blocks: list[ServedBlock],
                                                           executor: ThreadPoolExecutor) -> None:
    one_token = SessionCache.nbytes(tiny_blocks, 1, 1)

    async def scenario() -> None:
        handler = make_handler(tiny_blocks, executor, 32 * one_token, max_peer_cache_share=0.5)
        callers = [Caller(handler, peer(THIEF)) for _ in range(17)]
        for caller in callers[:16]:
            await asyncio.wait_for(caller.send(step(hidden_of(0), **{KEY_MAX_LENGTH: 0})), 20)
        with pytest.raises(RequestError, match="share"):
            await asyncio.wait_for(callers[16].send(step(hidden_of(0), **{KEY_MAX_LENGTH: 0})), 20)
        await honest_session(handler, tiny_blocks)
        for caller in callers[:16]:
            await caller.close()
        assert not handler.sessions._held and len(handler.sessions) == 0

    run(scenario())
