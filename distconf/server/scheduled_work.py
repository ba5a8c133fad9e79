"""What the compute scheduler queues (`distconf.server.scheduler`): the bounds of a batch (`BatchLimits`), a call
run as it is (`Task`: control work, forward and backward) and a session's inference step computed in chunks
(`Step`), each with the future its caller awaits."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from distconf.server.session_cache import SessionCache, StepPart

__all__ = ["INLINE_TOKENS", "BatchLimits", "Step", "Task", "Work", "new_tokens"]


@dataclass(frozen=True)
class BatchLimits:
    """Bounds of one batched inference step, and how long training work waits at most."""

    max_batch_size: int = 16
    """Rows (sequences) computed together; 1 turns batching off."""
    max_batch_tokens: int = 2048
    """Rows x padded new tokens of one batch (the activations a batch may take)."""
    prefill_chunk: int = 64
    """New tokens of one row per batch: longer steps are computed in chunks of this many."""
    training_patience: int = 8
    """Inference batches that may run between two forward/backward requests while one waits."""
    max_batch_bytes: int | None = None
    """Working memory of one batched block call (see ``activation_bytes``); None: unbounded."""
    max_batch_wait: float = 0.04
    """Seconds the first step of a batch may wait for the steps of steady sessions that are due
    (`distconf.server.arrivals`), so a group of sessions stays one batch from hop to hop; 0: never."""

    max_inline_seconds: float = 0.01
    """A lone step of at most `INLINE_TOKENS` tokens is computed on the event loop (no thread hand-off) while
    the last such step took at most this long; 0: always on the compute thread."""

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_batch_tokens", "prefill_chunk", "training_patience"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.max_batch_wait <= 10:
            raise ValueError(f"max_batch_wait must be between 0 and 10 seconds, got {self.max_batch_wait}")
        if not 0 <= self.max_inline_seconds <= 1:
            raise ValueError(f"max_inline_seconds must be between 0 and 1 second, got {self.max_inline_seconds}")


INLINE_TOKENS = 16
"""Most new tokens (rows x tokens) of a step computed on the event loop: decode and speculative steps, never a
prefill."""


def new_tokens(hidden: torch.Tensor) -> int:
    """Rows x new tokens of a step's hidden states."""
    return hidden.numel() // max(1, hidden.shape[-1])


def _resolve(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


@dataclass(eq=False, kw_only=True)
class Work:
    """Something queued for the compute thread, with the future its caller awaits."""

    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    order: int
    waited: int = 0

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        """Hand ``result`` (or ``error``) to the caller's event loop."""
        try:
            self.loop.call_soon_threadsafe(_resolve, self.future, result, error)
        except RuntimeError:  # the caller's loop is closed: nobody waits any more
            pass


@dataclass(eq=False, kw_only=True)
class Task(Work):
    """A call run as it is: control work or a forward/backward request of ``cost`` tokens."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    cost: int = 0

    def run(self) -> None:
        """Call ``fn`` and hand its result or error to the caller."""
        try:
            self.finish(self.fn(*self.args))
        except Exception as exc:
            self.finish(error=exc)


@dataclass(eq=False, kw_only=True)
class Step(Work):
    """An inference step of one session, computed in chunks of at most ``chunk`` tokens per row."""

    cache: SessionCache
    hidden: torch.Tensor
    prompts: Sequence[torch.Tensor | None]
    chunk: int
    arrived: float
    done: int = 0
    outputs: list[torch.Tensor] = field(default_factory=list)

    @property
    def rows(self) -> int:
        """Rows (the session's batch)."""
        return int(self.hidden.shape[0])

    def next_part(self) -> StepPart:
        """The next chunk of this step, at the cache's current position."""
        n = min(self.chunk, int(self.hidden.shape[1]) - self.done)
        return StepPart(self.cache, self.hidden[:, self.done:self.done + n], self.prompts)

    def rank(self) -> tuple[int, int]:
        """Short before long; every batch that passed this step over halves its length for the ranking."""
        n = min(self.chunk, int(self.hidden.shape[1]) - self.done)
        return (n >> min(self.waited, 62), self.order)

    def advance(self, output: torch.Tensor) -> bool:
        """Take one chunk's output; True when the whole step is done (the caller got its result)."""
        self.outputs.append(output)
        self.done += int(output.shape[1])
        if self.done < int(self.hidden.shape[1]):
            return False
        self.finish(self.outputs[0] if len(self.outputs) == 1 else torch.cat(self.outputs, dim=1))
        return True
