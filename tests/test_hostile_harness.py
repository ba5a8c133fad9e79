"""The hostile-server harness itself (no verification involved): each liar really lies, on every path.

One honest server and three hostile ones (`hostile_serve.py`: noise, identity, stale every 3rd
step) serve blocks 0:4 of one tiny float32 model; the same requests go to each of them straight
through the `distconf.rpc` helpers: ``rpc_forward``, ``rpc_backward``, one inference session
alone and several concurrent sessions (batched by the servers), and the replies are compared
with the honest server's.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from dhthelpers import wait_for_async
from hostile_helpers import start_honest, start_hostile
from swarm_harness import Swarm

from distconf.client.verify_compare import DEFAULT_TOLERANCES, update_difference
from distconf.tools.serving import ServerProcess

pytestmark = pytest.mark.swarm

EVERY = 3
BLOCKS = (0, 4)
CLOSE = {"atol": 1e-5, "rtol": 1e-4}


class Harness:
    """The bootstrap DHT, the model folder, the honest server and the three liars, an RPC loop."""

    def __init__(self, root: Path) -> None:
        from distconf.rpc import RpcLoop

        self.root = root
        self.swarm = Swarm(root, "llama")  # owns the node and the servers
        try:
            self.dht, peers = self.swarm.dht, self.swarm.peers
            self.model_dir, self.config = self.swarm.model_dir, self.swarm.config
            span = f"{BLOCKS[0]}:{BLOCKS[1]}"
            self.servers: dict[str, ServerProcess] = {
                "honest": self.swarm.add_server(start_honest(self.model_dir, peers, span, root / "honest.log"))}
            for mode in ("noise", "identity", "stale"):
                self.servers[mode] = self.swarm.add_server(start_hostile(
                    mode, self.model_dir, peers, span, root / f"{mode}.log", every=EVERY if mode == "stale" else None))
            self.swarm.wait_ready()
            self.loop = RpcLoop(self.dht)
            self.swarm.on_close(self.loop.shutdown)
        except BaseException:
            self.swarm.close()
            raise

    @property
    def uid(self) -> str:
        from distconf.rpc import chain_uid

        return chain_uid(self.config.dht_prefix, *BLOCKS)

    def peer(self, name: str) -> str:
        return self.servers[name].peer_id

    def run(self, coro: Any, timeout: float = 60.0) -> Any:
        return self.loop.run(coro, timeout=timeout)

    def hidden(self, batch: int, length: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(batch, length, self.config.hidden_size, generator=g)

    def close(self) -> None:
        self.swarm.close()


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Any:
    h = Harness(tmp_path_factory.mktemp("hostile-harness"))
    try:
        yield h
    finally:
        h.close()


def differs(inputs: torch.Tensor, honest: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Per position: whether ``other`` is further from ``honest`` than floating-point noise (1e-3 of the update)."""
    return update_difference(inputs, honest, other) > 1e-3


async def session_outputs(h: Harness, peer: str, steps: list[torch.Tensor],
                          opened: Callable[[], Awaitable[None]] | None = None) -> list[torch.Tensor]:
    """The replies of one inference session on ``peer`` to ``steps`` (one message each); ``opened``
    is awaited once the stream is open, before the first step."""
    from distconf.rpc import InferenceStream, deserialize_tensors, inference_step_request

    stream = await InferenceStream.open(h.loop.p2p, peer, timeout=10)
    outputs = []
    try:
        if opened is not None:
            await opened()
        for i, hidden in enumerate(steps):
            meta: dict[str, Any] = {"step_id": str(uuid.uuid4())}
            if i == 0:
                meta.update(max_length=64, session_id=str(uuid.uuid4()))
            reply = await stream.step(inference_step_request(h.uid, hidden, metadata=meta), timeout=20)
            outputs.append(deserialize_tensors(reply.tensors)[0])
    finally:
        await stream.close(timeout=5)
    return outputs


def session_steps(h: Harness, seed: int, decode: int = 8) -> list[torch.Tensor]:
    """A 5-token prefill then ``decode`` one-token steps, batch 1."""
    return [h.hidden(1, 5, seed)] + [h.hidden(1, 1, seed * 100 + i) for i in range(decode)]


def test_forward_lies_as_the_mode_says(harness: Harness) -> None:
    from distconf.rpc import call_forward

    x = harness.hidden(2, 6, seed=1)
    out = {name: harness.run(call_forward(harness.loop.p2p, harness.peer(name), harness.uid, x, timeout=30))
           for name in harness.servers}
    assert torch.equal(out["identity"], x)  # skipped compute: the reply is the inputs
    assert not torch.allclose(out["honest"], x, **CLOSE)
    noise = update_difference(x, out["honest"], out["noise"])
    print(f"noise liar's update difference: min {noise.min():.3g}, max {noise.max():.3g}")
    assert (noise > 10 * DEFAULT_TOLERANCES[torch.float32]).all()  # well above honest float32 noise
    assert torch.allclose(out["stale"], out["honest"], **CLOSE)  # stale lies only in inference steps


def test_backward_lies_as_the_mode_says(harness: Harness) -> None:
    from distconf.rpc import call_backward

    x, grad = harness.hidden(1, 4, seed=2), harness.hidden(1, 4, seed=3)
    out = {name: harness.run(call_backward(harness.loop.p2p, harness.peer(name), harness.uid, x, grad,
                                           timeout=30))[0] for name in harness.servers}
    assert torch.equal(out["identity"], grad)  # identity blocks pass the gradient through
    assert not torch.allclose(out["honest"], grad, **CLOSE)
    assert not torch.allclose(out["noise"], out["honest"], **CLOSE)
    assert torch.allclose(out["stale"], out["honest"], **CLOSE)


def check_session(steps: list[torch.Tensor], got: dict[str, list[torch.Tensor]]) -> None:
    """Each liar's replies against the honest ones, step by step (stale: exactly every EVERY-th step)."""
    honest = got["honest"]
    for i, (x, ref) in enumerate(zip(steps, honest, strict=True)):
        assert torch.equal(got["identity"][i], x), f"identity, step {i + 1}"
        assert differs(x, ref, got["noise"][i]).all(), f"noise, step {i + 1}"
        lied = (i + 1) % EVERY == 0
        assert bool(differs(x, ref, got["stale"][i]).any()) == lied, f"stale, step {i + 1}"
        if lied:  # yesterday's hidden states: the previous reply's last position (its honest value)
            assert not differs(x, honest[i - 1][:, -1:], got["stale"][i]).any(), f"stale, step {i + 1}"


def test_one_session_lies_as_the_mode_says(harness: Harness) -> None:
    steps = session_steps(harness, seed=4)
    got = {name: harness.run(session_outputs(harness, harness.peer(name), steps)) for name in harness.servers}
    check_session(steps, got)


def batched_rows(h: Harness, name: str) -> int:
    from distconf.rpc import call_info

    info = h.run(call_info(h.loop.p2p, h.peer(name), timeout=10))
    return int(info["stats"].get("batched_rows", 0))


def test_concurrent_sessions_lie_in_batches(harness: Harness) -> None:
    """Four sessions at once on each server: their steps are batched (step_together) and still lie.

    Steps overlap by timing, and a tiny model computes a step faster than a loaded machine
    delivers the next session's message: so each round starts with a forward that keeps the
    server's one compute thread busy while the four sessions' prefills arrive and queue.
    """
    from distconf.rpc import call_forward, call_info

    sessions = [session_steps(harness, seed=10 + s, decode=9) for s in range(4)]
    before = {name: batched_rows(harness, name) for name in harness.servers}

    async def forwards_started(peer: str) -> int:
        """Forwards (and backwards) the server's compute thread has started running."""
        return int((await call_info(harness.loop.p2p, peer, timeout=10))["stats"].get("training", 0))

    async def all_sessions(peer: str, busy: torch.Tensor) -> list[list[torch.Tensor]]:
        opened, go = asyncio.Barrier(len(sessions) + 1), asyncio.Event()

        async def when_busy() -> None:
            await opened.wait()
            await go.wait()

        runs = asyncio.gather(*(session_outputs(harness, peer, steps, when_busy) for steps in sessions))
        await asyncio.wait_for(opened.wait(), timeout=30)  # every stream is open
        started = await forwards_started(peer)
        forward = asyncio.ensure_future(call_forward(harness.loop.p2p, peer, harness.uid, busy, timeout=60))

        async def forward_computing() -> bool:  # the forward reached the server first: its compute thread is busy
            return forward.done() or await forwards_started(peer) > started

        await wait_for_async(forward_computing, timeout=10, interval=0.01)
        go.set()
        outputs = await runs
        await forward
        return list(outputs)

    got = {}
    for name in harness.servers:
        limit = int(harness.run(call_info(harness.loop.p2p, harness.peer(name), timeout=10))["max_forward_tokens"])
        busy = harness.hidden(1, limit, seed=99)
        for _ in range(3):
            started = time.monotonic()
            got[name] = harness.run(all_sessions(harness.peer(name), busy), timeout=120)
            print(f"{name}: round {time.monotonic() - started:.2f} s, {batched_rows(harness, name)} rows batched")
            if batched_rows(harness, name) > before[name]:
                break
        assert batched_rows(harness, name) > before[name], f"{name}: no batch formed in 3 rounds"
    for s, steps in enumerate(sessions):
        check_session(steps, {name: got[name][s] for name in harness.servers})


def test_the_liars_say_so_in_their_logs(harness: Harness) -> None:
    for mode in ("noise", "identity", "stale"):
        log = harness.servers[mode].log_path
        assert log is not None and f"HOSTILE server: mode {mode}" in log.read_text(encoding="utf-8")
    assert "HOSTILE" not in (harness.servers["honest"].log_path or Path()).read_text(encoding="utf-8")


def test_the_noise_liar_claims_the_honest_digests(harness: Harness) -> None:
    """Its weights differ, yet it announces the honest block digests: a digest is a claim (spot checks catch it)."""
    from distconf.rpc import call_info

    infos = {name: harness.run(call_info(harness.loop.p2p, harness.peer(name), timeout=10))
             for name in ("honest", "noise")}
    assert infos["honest"].get("block_sha256"), "the honest server announces no block digests"
    assert infos["noise"].get("block_sha256") == infos["honest"]["block_sha256"]
