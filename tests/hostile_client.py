"""A hostile client for tests: raw messages to a real ``distconf serve`` process, and the checks on its victim.

`HostileClient` sends what no honest client would (metadata bytes crafted by the test, any
message order) straight through the p2p daemon, with every wait bounded; an outcome is
``("ok", reply)`` or ``("refused", text)`` and never raises for what the server does.
`Victim` is the server under attack and what the issue checks after each case: alive, an
honest forward and a 2-step session giving the same outputs as before, the cache budget back
to full, no traceback and no flood in its log, its RSS.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
from dhthelpers import wait_for
from hivemind.proto import runtime_pb2

from distconf.tools.serving import ServerProcess

__all__ = ["HostileClient", "Victim", "raw_request"]

TIMEOUT = 30.0
"""Seconds any one call of the harness may take (the machine is shared and loaded)."""


def raw_request(uid: str, tensors: list[torch.Tensor], metadata: bytes) -> runtime_pb2.ExpertRequest:
    """A request whose metadata is ``metadata`` as given (no msgpack encoding by the harness)."""
    from distconf.rpc import serialize_tensors

    return runtime_pb2.ExpertRequest(uid=uid, tensors=serialize_tensors(tensors), metadata=metadata)


class HostileClient:
    """Raw RPCs to servers from a loop of its own (a P2P replicated from ``dht``)."""

    def __init__(self, dht: Any) -> None:
        from distconf.rpc import RpcLoop

        self.loop = RpcLoop(dht)

    def run(self, coro: Any, timeout: float = TIMEOUT) -> Any:
        """Run ``coro`` on the harness's loop (bounded)."""
        return self.loop.run(coro, timeout=timeout + 5)

    def outcome(self, coro: Any, timeout: float = TIMEOUT) -> tuple[str, Any]:
        """``("ok", result)`` or ``("refused", error text)`` of ``coro`` (server error, closed stream, timeout)."""
        try:
            return "ok", self.run(asyncio.wait_for(coro, timeout), timeout)
        except Exception as exc:
            return "refused", f"{type(exc).__name__}: {exc}"

    def forward(self, peer: str, request: runtime_pb2.ExpertRequest, timeout: float = TIMEOUT) -> tuple[str, Any]:
        """Send ``request`` as one ``rpc_forward``."""
        from distconf.rpc import get_stub

        return self.outcome(get_stub(self.loop.p2p, peer).rpc_forward(request, timeout=timeout), timeout)

    def push(self, peer: str, request: runtime_pb2.ExpertRequest, timeout: float = TIMEOUT) -> tuple[str, Any]:
        """Send ``request`` as one ``rpc_push`` (any peer may call it)."""
        from distconf.rpc import call_push

        return self.outcome(call_push(self.loop.p2p, peer, request, timeout=timeout), timeout)

    def inference(self, peer: str, messages: list[runtime_pb2.ExpertRequest], timeout: float = TIMEOUT
                  ) -> tuple[str, Any]:
        """Open an ``rpc_inference`` stream, send ``messages``, and return the first reply (or why there is none)."""
        from distconf.rpc import InferenceStream

        async def session() -> Any:
            stream = await InferenceStream.open(self.loop.p2p, peer, timeout=timeout)
            try:
                for message in messages:
                    await stream.send(message)
                return await stream.receive(timeout=timeout)
            finally:
                await stream.close(timeout=5)

        return self.outcome(session(), timeout)

    def info(self, peer: str, timeout: float = TIMEOUT) -> dict[str, Any]:
        """The server's ``rpc_info`` (raises if it does not answer)."""
        from distconf.rpc import call_info

        return self.run(call_info(self.loop.p2p, peer, timeout=timeout), timeout)

    def shutdown(self) -> None:
        """Close the harness's P2P and loop."""
        self.loop.shutdown()


@dataclass
class Victim:
    """A server under attack: its process, the chain it serves and what its honest callers got before."""

    server: ServerProcess
    client: HostileClient
    uid: str
    hidden_size: int
    reference: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    full_budget: int = 0

    def __post_init__(self) -> None:
        self.reference = self.honest_outputs()
        self.full_budget = self.cache_tokens()

    @property
    def peer(self) -> str:
        """The server's peer id."""
        return self.server.peer_id

    def hidden(self, length: int, seed: int) -> torch.Tensor:
        """Honest hidden states, batch 1."""
        return torch.randn(1, length, self.hidden_size, generator=torch.Generator().manual_seed(seed))

    def honest_outputs(self) -> dict[str, list[torch.Tensor]]:
        """An honest caller's forward and 2-step session outputs (the same inputs every time)."""
        from distconf.rpc import InferenceStream, call_forward, deserialize_tensors, inference_step_request

        p2p = self.client.loop.p2p
        forward = self.client.run(call_forward(p2p, self.peer, self.uid, self.hidden(4, 1), timeout=TIMEOUT))

        async def session() -> list[torch.Tensor]:
            stream = await InferenceStream.open(p2p, self.peer, timeout=TIMEOUT)
            outputs = []
            try:
                for i, hidden in enumerate([self.hidden(3, 2), self.hidden(1, 3)]):
                    meta: dict[str, Any] = {"step_id": str(uuid.uuid4())}
                    if i == 0:
                        meta.update(max_length=16, session_id=str(uuid.uuid4()))
                    reply = await stream.step(inference_step_request(self.uid, hidden, metadata=meta), timeout=TIMEOUT)
                    outputs.append(deserialize_tensors(reply.tensors)[0])
            finally:
                await stream.close(timeout=5)
            return outputs

        return {"forward": [forward], "session": self.client.run(session())}

    def cache_tokens(self) -> int:
        """``cache_tokens_available`` from the server's ``rpc_info``."""
        from distconf.rpc.protocol import CACHE_TOKENS_AVAILABLE

        return int(self.client.info(self.peer)[CACHE_TOKENS_AVAILABLE])

    def log_mark(self, quiet: float = 0.3, timeout: float = 10.0) -> int:
        """Where the server's log ends once it has written nothing for ``quiet`` seconds (at most ``timeout``): the
        lines of the previous case (a stream's close, its refusal) land after it returned. Pass it to `log_since`."""
        seen = [len(self.server.log_tail(10**9)), time.monotonic()]

        def settled() -> bool:
            now = len(self.server.log_tail(10**9))
            if now != seen[0]:
                seen[:] = [now, time.monotonic()]
            return time.monotonic() - seen[1] >= quiet

        wait_for(settled, timeout=timeout, interval=0.05)
        return seen[0]

    def log_since(self, mark: int) -> str:
        """The server's log after ``mark``."""
        return self.server.log_tail(10**9)[mark:]

    def unaffected(self) -> list[str]:
        """What differs from before the attack (empty when the server is alive and honest callers unaffected)."""
        problems = []
        if not self.server.alive:
            return [f"the server exited with code {self.server.proc.poll()}"]
        now = self.honest_outputs()
        for name, outputs in self.reference.items():
            if not all(torch.allclose(a, b, atol=1e-6, rtol=1e-5) for a, b in zip(outputs, now[name], strict=True)):
                problems.append(f"the honest {name} outputs changed")
        if not self.budget_back(deadline=time.monotonic() + TIMEOUT):
            problems.append(f"the cache budget is not back to full ({self.cache_tokens()} of {self.full_budget})")
        return problems

    def budget_back(self, deadline: float) -> bool:
        """Whether ``cache_tokens_available`` is back to full by ``deadline`` (monotonic; sessions end async)."""
        return bool(wait_for(lambda: self.cache_tokens() == self.full_budget,
                             timeout=max(0.0, deadline - time.monotonic()), interval=0.1))

    def rss_mib(self) -> float:
        """The server process's resident memory in MiB."""
        import psutil

        return psutil.Process(self.server.proc.pid).memory_info().rss / 2**20
