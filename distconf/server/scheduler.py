"""`ComputeScheduler`: what a server's one compute thread runs next.

Everything a server computes goes through one scheduler, run on the server's compute
executor (one thread), in this order:

1. control work (allocating a session's cache, reordering it), at once;
2. inference steps, **batched**: the steps of all sessions that are ready when the thread
   becomes free are computed together, one block call per block (`step_together`), as many
   rows as ``max_batch_size`` allows and no more than ``max_batch_tokens`` padded tokens.
   A batch also stays within ``max_batch_bytes`` of working memory (the plan's reserve).
   A step longer than ``prefill_chunk`` tokens per row (a prefill) is split into chunks; each
   chunk is one batch, so other sessions' decode steps run between the chunks. Short steps go
   before long ones, and a step passed over gains priority with every batch that passes it;
3. forward/backward requests (training), shortest first (a request passed over gains priority
   the same way), when no inference step is ready, or when ``training_patience`` inference
   batches ran since the last training request: inference never waits behind training, and
   training is not starved by a steady stream of decode steps.

Before a batch starts, its first step may wait up to ``max_batch_wait`` for the steps of
steady sessions that are due (`distconf.server.arrivals`): in a pipeline the steps of a
group of sessions arrive one message at a time, and a batch started with the first would
split the group at every hop.

A lone step (the only session open on the server, nothing queued or running, a few tokens, and the last such step
computed within ``max_inline_seconds``) is computed on the event loop itself: at batch 1 the two
thread hand-offs cost more than a small model's step (``benchmarks/bench_hop.py``). The loop
claims the compute as the thread would, so nothing else computes meanwhile.

Sessions join and leave between batches; a session that stalls is simply not in the next
batch. A step whose caller went away (its future cancelled) is dropped before it runs. If a
batch fails, its steps are retried one by one, so an error reaches only the step that causes it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, TypeVar

import torch

from distconf.server.arrivals import Arrivals
from distconf.server.scheduled_work import INLINE_TOKENS, BatchLimits, Step, Task, Work, new_tokens
from distconf.server.session_cache import SessionCache, StepPart, batch_key, step_together

__all__ = ["BatchLimits", "ComputeScheduler"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ComputeScheduler:
    """Runs a server's compute on ``executor`` in priority order (see the module docstring).

    Awaited from the server's event loop; ``stats`` counts ``batches`` (and their compute in
    ``step_seconds``), ``inline_steps`` (computed on the event loop), ``batched_rows``
    (rows computed in batches of more than one session), ``max_batch_rows`` and ``training``.
    """

    def __init__(self, executor: Executor, limits: BatchLimits | None = None,
                 activation_bytes: Callable[[int, int, int], int] | None = None) -> None:
        """``activation_bytes(rows, new_tokens, past)``: the working memory of one block call
        (`distconf.planning.batch_activation_bytes` for the served config), checked against
        ``limits.max_batch_bytes`` before a session's step joins a batch."""
        self.executor = executor
        self.limits = limits or BatchLimits()
        self.activation_bytes = activation_bytes
        self.stats: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._arrivals = Arrivals()
        self._control: list[Task] = []
        self._training: list[Task] = []
        self._steps: list[Step] = []
        self._pumping = False
        self._order = itertools.count()
        self._batches_since_training = 0
        self._lone_seconds: float | None = None  # the last lone step of at most INLINE_TOKENS tokens

    @property
    def idle(self) -> bool:
        """Nothing is queued and the compute thread is not running (a lone step would be computed on the loop)."""
        with self._lock:
            return not (self._pumping or self._control or self._training or self._steps)

    @property
    def queued_steps(self) -> int:
        """Inference steps waiting for (or in) the compute thread."""
        with self._lock:
            return len(self._steps)

    # ------------------------------------------------------------------ submitting

    def _submit(self, work: Work, queue: list[Any]) -> None:
        with self._lock:
            queue.append(work)
            if isinstance(work, Step):
                self._arrivals.arrived(work.cache, work.arrived)
            self._wake.notify()
            if self._pumping:
                return
            self._pumping = True
        try:
            self.executor.submit(self._drain)
        except RuntimeError:  # the executor is shut down: the server is stopping
            with self._lock:
                self._pumping = False
                queue.remove(work)
            raise

    def _work(self, cls: type[Work], **fields: Any) -> Any:
        loop = asyncio.get_running_loop()
        return cls(future=loop.create_future(), loop=loop, order=next(self._order), **fields)

    async def run(self, fn: Callable[..., T], *args: Any, cost: int | None = None) -> T:
        """``fn(*args)`` in the compute thread: control work (``cost=None``, at once) or a
        forward/backward request of ``cost`` tokens (after inference steps)."""
        task = self._work(Task, fn=fn, args=args, cost=cost or 0)
        self._submit(task, self._control if cost is None else self._training)
        return await task.future

    async def step(self, cache: SessionCache, hidden: torch.Tensor, prompts: Sequence[torch.Tensor | None],
                   hypo_ids: torch.Tensor | None, *, lone: bool = False) -> torch.Tensor:
        """One inference step of a session (as ``cache.step``), computed together with other sessions' steps.

        ``lone``: the caller knows no other session is open on this server (the step may run on the loop)."""
        if hidden.shape[1] == 0:
            return await self.run(cache.step, hidden, prompts, hypo_ids)
        if hypo_ids is not None:
            await self.run(cache.reorder, hypo_ids)
        chunk = max(1, min(self.limits.prefill_chunk, self.limits.max_batch_tokens // max(1, hidden.shape[0])))
        if lone and hidden.shape[1] <= chunk and self._claim_inline(cache, hidden):
            return self._run_inline(cache, hidden, prompts)
        step = self._work(Step, cache=cache, hidden=hidden, prompts=prompts, chunk=chunk, arrived=time.monotonic())
        self._submit(step, self._steps)
        return await step.future

    def _claim_inline(self, cache: SessionCache, hidden: torch.Tensor) -> bool:
        """Whether this step runs on the event loop; if so, the compute is claimed (the thread stays idle)."""
        limit = self.limits.max_inline_seconds
        if (limit <= 0 or new_tokens(hidden) > INLINE_TOKENS
                or self._lone_seconds is None or self._lone_seconds > limit):
            return False
        with self._lock:
            if self._pumping or self._control or self._training or self._steps:
                return False
            now = time.monotonic()
            if not self._fits(int(hidden.shape[0]), int(hidden.shape[1]), cache.position):
                return False
            self._arrivals.arrived(cache, now)
            self._pumping = True
            return True

    def _run_inline(self, cache: SessionCache, hidden: torch.Tensor,
                    prompts: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """Compute a claimed lone step here, then hand the compute back (to the thread if work queued meanwhile)."""
        start = time.perf_counter()
        try:
            (output,) = step_together([StepPart(cache, hidden, prompts)])
        finally:
            self._lone_seconds = time.perf_counter() - start
            with self._lock:
                self.stats["step_seconds"] += self._lone_seconds
                self.stats["batches"] += 1
                self.stats["inline_steps"] += 1
                self._arrivals.computed((cache,), self.stats["batches"])
                self._pumping = bool(self._control or self._training or self._steps)
                pump = self._pumping
            if pump:
                try:
                    self.executor.submit(self._drain)
                except RuntimeError:  # the executor is shut down: the server is stopping
                    with self._lock:
                        self._pumping = False
        return output

    # ------------------------------------------------------------------ the compute thread

    def _drain(self) -> None:
        while True:
            with self._lock:
                while True:
                    run, wait = self._next()
                    if run is not None or wait is None:
                        break
                    self._wake.wait(wait)  # a submission wakes it early
                if run is None:
                    self._pumping = False
                    return
            run()

    def _next(self) -> tuple[Callable[[], None] | None, float | None]:
        """What to run next, or how long to wait for more steps (called with the lock held);
        ``(None, None)`` when nothing is queued."""
        for queue in (self._control, self._training, self._steps):
            queue[:] = [w for w in queue if not w.future.cancelled()]
        if self._control:
            return self._control.pop(0).run, None
        patience = self.limits.training_patience
        if self._training and (not self._steps or self._batches_since_training >= patience):
            task = min(self._training, key=lambda t: (t.cost >> min(t.waited, 62), t.order))
            self._training.remove(task)
            for t in self._training:
                t.waited += 1
            self._batches_since_training = 0
            self.stats["training"] += 1
            return task.run, None
        if not self._steps:
            return None, None
        wait = self._gather_wait()
        if wait > 0:
            return None, wait
        batch = self._form_batch()
        if self._training:
            self._batches_since_training += 1
        for s in self._steps:
            if s not in batch:
                s.waited += 1
        return (lambda: self._run_batch(batch)), None

    def _gather_wait(self) -> float:
        """Seconds to wait before the next batch: while a steady session is due (see
        `distconf.server.arrivals`), up to ``max_batch_wait`` after the oldest queued step arrived."""
        limit = self.limits.max_batch_wait
        if limit <= 0 or sum(s.rows for s in self._steps) >= self.limits.max_batch_size:
            return 0.0
        now = time.monotonic()
        deadline = min(s.arrived for s in self._steps) + limit
        if deadline <= now:
            return 0.0
        chain = tuple(b.uid for b in self._steps[0].cache.blocks)
        return deadline - now if self._arrivals.due(now, deadline, (s.cache for s in self._steps), chain) else 0.0

    def _form_batch(self) -> list[Step]:
        """The next batch: the best-ranked step, and the steps that may join it."""
        limits = self.limits
        ranked = sorted(self._steps, key=Step.rank)
        anchor = ranked[0]
        key = batch_key(anchor.next_part())
        batch, rows, width, past = [anchor], anchor.rows, anchor.next_part().length, anchor.cache.position
        real = rows * width
        for s in ranked[1:]:
            if rows + s.rows > limits.max_batch_size:
                continue
            part = s.next_part()
            if batch_key(part) != key:
                continue
            new_rows, new_width, new_past = rows + s.rows, max(width, part.length), max(past, s.cache.position)
            new_real = real + s.rows * part.length
            # a row joins within the token bound and if at least half of the padded batch is real tokens
            if new_width * new_rows > limits.max_batch_tokens or 2 * new_real < new_width * new_rows:
                continue
            if not self._fits(new_rows, new_width, new_past):
                continue
            batch.append(s)
            rows, width, past, real = new_rows, new_width, new_past, new_real
        return batch

    def _fits(self, rows: int, width: int, past: int) -> bool:
        """Whether a batch of ``rows x width`` new tokens after ``past`` stays within ``max_batch_bytes``."""
        limit = self.limits.max_batch_bytes
        return limit is None or self.activation_bytes is None or self.activation_bytes(rows, width, past) <= limit

    def _run_batch(self, batch: list[Step]) -> None:
        parts = [s.next_part() for s in batch]
        start = time.perf_counter()
        try:
            outputs = step_together(parts)
        except Exception as exc:
            if len(batch) == 1:
                self._forget(batch)
                batch[0].finish(error=exc)
                return
            logger.warning("a batch of %d steps failed (%r); computing them one by one", len(batch), exc)
            for step in batch:
                self._run_batch([step])
            return
        seconds = time.perf_counter() - start
        if len(parts) == 1 and new_tokens(parts[0].hidden) <= INLINE_TOKENS:
            self._lone_seconds = seconds
        self.stats["step_seconds"] += seconds
        self.stats["batches"] += 1
        with self._lock:
            self._arrivals.computed((s.cache for s in batch), self.stats["batches"])
        if len(batch) > 1:
            self.stats["batched_rows"] += sum(s.rows for s in batch)
        self.stats["max_batch_rows"] = max(self.stats["max_batch_rows"], sum(s.rows for s in batch))
        finished = [s for s, out in zip(batch, outputs) if s.advance(out)]
        for s in batch:
            s.waited = 0
        self._forget(finished)

    def _forget(self, steps: list[Step]) -> None:
        with self._lock:
            self._steps[:] = [s for s in self._steps if s not in steps]
