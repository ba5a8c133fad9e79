"""Driving a real `BlockHandler` without a swarm: tiny served blocks and ``rpc_inference`` callers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from blockhelpers import family_config

from distconf.blocks import build_block, kv_geometry
from distconf.rpc import chain_uid, deserialize_tensors, inference_step_request
from distconf.server.compute import ServedBlock
from distconf.server.handler import BlockHandler, HandlerSettings
from distconf.server.memory import CacheBudget
from distconf.server.scheduler import BatchLimits

PREFIX = "sessions-test"
CONTEXT: Any = SimpleNamespace(remote_id="peer-abcdef")


def tiny_served(num_blocks: int = 2, hidden: int = 64, **overrides: Any) -> list[ServedBlock]:
    """Real tiny blocks of the family file used by the server tests (random weights), as a server holds them."""
    config, _, _ = family_config("llama", num_hidden_layers=num_blocks, hidden_size=hidden, **overrides)
    torch.manual_seed(0)
    modules = [build_block(config, i, device="cpu", dtype=torch.float32).requires_grad_(False)
               for i in range(num_blocks)]
    geometry = kv_geometry(config)
    per_token = geometry.values_per_token * 4
    uids = [chain_uid(PREFIX, i, i + 1) for i in range(num_blocks)]
    return [ServedBlock(uid, i, m, torch.float32, geometry, per_token) for i, (uid, m) in enumerate(zip(uids, modules))]


def make_handler(served: list[ServedBlock], executor: ThreadPoolExecutor, budget_bytes: int,
                 limits: BatchLimits | None = None, *, hidden: int = 64, max_length: int = 64,
                 **settings_kw: Any) -> BlockHandler:
    """A handler over ``served`` with a cache budget of ``budget_bytes`` (not registered on any P2P);
    ``settings_kw``: more `HandlerSettings` (e.g. ``max_forward_tokens``, ``max_peer_cache_share``)."""
    settings = HandlerSettings(dht_prefix=PREFIX, hidden_size=hidden, dtype=torch.float32,
                               inference_max_length=max_length, **{"step_timeout": 20, "session_timeout": 60,
                                                                   **settings_kw})
    return BlockHandler(served, CacheBudget(budget_bytes), settings, executor, limits)


class Caller:
    """One ``rpc_inference`` stream: messages put by the test, replies read from the handler."""

    def __init__(self, handler: BlockHandler, context: Any = CONTEXT) -> None:
        """``context``: the caller as the handler sees it (``remote_id``: its peer id)."""
        self.messages: asyncio.Queue[Any] = asyncio.Queue()
        self.replies = handler.rpc_inference(self._requests(), context)

    async def _requests(self) -> AsyncIterator[Any]:
        while (message := await self.messages.get()) is not None:
            yield message

    def send(self, message: Any) -> asyncio.Future[Any]:
        """Put ``message`` on the stream; the future is the next reply."""
        self.messages.put_nowait(message)
        return asyncio.ensure_future(self.replies.__anext__())

    async def close(self) -> None:
        """End the stream; the session must end with it."""
        self.messages.put_nowait(None)
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(self.replies.__anext__(), 20)


def step(hidden: torch.Tensor, num_blocks: int = 2, **metadata: Any) -> Any:
    """A step message for blocks ``0..num_blocks-1``."""
    return inference_step_request(chain_uid(PREFIX, 0, num_blocks), hidden, metadata=metadata)


def output(reply: Any) -> torch.Tensor:
    """The hidden states of a reply."""
    (tensor,) = deserialize_tensors(reply.tensors)
    return tensor
