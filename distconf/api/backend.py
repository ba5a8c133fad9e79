"""The model behind the API: token ids of a request, its generation in a worker thread, errors as `ApiError`.

`Backend` owns the distributed model and its tokenizer. `Backend.start` runs the
``n`` choices of one request, one new inference session each
(`distconf.client.textgen.stream_text`), in a bounded thread pool (the client is
synchronous) and hands every `Piece` to the event loop through an asyncio queue as
`Event` objects. `Generation.cancel` (a client that went away) closes the sessions at
once. Failures become `ApiError`: the swarm unreachable or without a route is a 503 with
the client's reason, anything else a 500 (logged with its traceback, never shown).
`Backend.verification` lists the servers the model's spot checks caught (its
``verification_events``) for ``GET /distconf/verification``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from distconf.api.protocol import ApiError, Request
from distconf.client.sequence_manager import RetriesExhausted
from distconf.client.textgen import Piece, Sampling, TextStream, chat_input_ids, stream_text
from distconf.dht import NoRouteError
from distconf.loader.positions import max_positions

__all__ = ["Backend", "Event", "Generation", "swarm_error"]

logger = logging.getLogger(__name__)

DEFAULT_CHAT_TOKENS = 512
"""``max_tokens`` of a chat request that gives none (at most what the context has left)."""
MAX_EVENTS_LISTED = 1000
"""Most verification events one ``GET /distconf/verification`` lists (the latest)."""


@dataclass(frozen=True)
class Event:
    """What a generation thread reports: a piece of choice ``index``, its end, or an error.

    ``kind`` is ``"piece"`` (``piece`` set), ``"end"`` (``stream`` set: its ``finish_reason``
    and counts), ``"error"`` (``error`` set) or ``"done"`` (every choice ended).
    """

    kind: str
    index: int = 0
    piece: Piece | None = None
    stream: TextStream | None = None
    error: ApiError | None = None


def swarm_error(exc: BaseException) -> ApiError:
    """The `ApiError` for a failure while generating (503: the swarm cannot serve; 500: anything else)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, (RetriesExhausted, NoRouteError, ConnectionError, TimeoutError)):
        cause = exc.__cause__ if isinstance(exc, RetriesExhausted) and exc.__cause__ is not None else exc
        reason = str(cause) or type(cause).__name__
        return ApiError(503, f"the swarm cannot serve this model now: {reason}", type="server_error",
                        code="no_route" if isinstance(cause, NoRouteError) else "swarm_unavailable")
    logger.error("generation failed", exc_info=(type(exc), exc, exc.__traceback__))
    return ApiError(500, f"internal error while generating ({type(exc).__name__}); see the server's log",
                    type="server_error", code="internal_error")


class Generation:
    """The choices of one request being generated: events arrive on ``queue``; `cancel` stops them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.streams: list[TextStream] = []
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def put(self, event: Event) -> None:
        """Hand ``event`` to the event loop (from the worker thread)."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def cancel(self) -> None:
        """Stop generating and end every session now (safe from the event loop: never blocks)."""
        self.cancelled.set()
        for stream in list(self.streams):
            stream.close()


class Backend:
    """A distributed model with its tokenizer, served under ``model_id``, and under one more id per LoRA adapter.

    :param max_concurrent: most requests generating at once (each holds a thread); later ones wait.
    :param max_waiting: most requests waiting for a thread; more are refused (429).
    :param verification_events: the model's ``verification_events`` (a list the model appends
        to; None: the model does not verify its servers).
    :param verify_fraction: the share of steps the model spot-checks (reported as is).
    :param speculation: makes the `distconf.client.speculative.Speculation` of each generation (None: none).
    :param adapters: ``{model id: adapter name}``: each id serves the model through that LoRA adapter (the
        servers' ``--adapters``), batched on the servers with every other id's requests.
    """

    def __init__(self, model: Any, tokenizer: Any, model_id: str, *, max_concurrent: int = 8,
                 max_waiting: int = 64, created: int = 0, verification_events: Sequence[Any] | None = None,
                 verify_fraction: float = 0.0, speculation: Callable[[], Any] | None = None,
                 adapters: Mapping[str, str] | None = None) -> None:
        self.model, self.tokenizer, self.model_id, self.created = model, tokenizer, model_id, created
        self.adapters = dict(adapters or {})
        if model_id in self.adapters:
            raise ValueError(f"model id {model_id!r} names both the base model and an adapter")
        self.verification_events, self.verify_fraction = verification_events, float(verify_fraction)
        self.speculation = speculation
        self.context = max_positions(model.config) or int(getattr(model.config, "max_position_embeddings", 0) or 2048)
        self.max_concurrent, self.max_waiting = max_concurrent, max_waiting
        self.executor = ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix="distconf-api-gen")
        self._lock = threading.Lock()
        self._pending = 0  # requests generating or waiting

    @property
    def model_ids(self) -> list[str]:
        """Every id this server serves: the base model's, then each adapter's."""
        return [self.model_id, *self.adapters]

    def check_model(self, model: str) -> str | None:
        """The adapter of model id ``model`` (None: the base model); 404 for an id this server does not serve."""
        if model == self.model_id:
            return None
        if model in self.adapters:
            return self.adapters[model]
        served = ", ".join(f"'{m}'" for m in self.model_ids)
        raise ApiError(404, f"The model '{model}' does not exist; this server serves {served}", param="model",
                       code="model_not_found")

    def input_ids(self, request: Request) -> list[int]:
        """The prompt's token ids (chat: through the chat template)."""
        if request.kind == "chat":
            try:
                return chat_input_ids(self.tokenizer, list(request.messages))
            except ValueError as exc:
                raise ApiError(400, str(exc), param="messages") from None
            except Exception as exc:  # a template may raise its own errors (e.g. role order)
                raise ApiError(400, f"the chat template refused these messages: {exc}", param="messages") from None
        return [int(i) for i in self.tokenizer(request.prompt)["input_ids"]]

    def sampling(self, request: Request, prompt_tokens: int) -> Sampling:
        """The request's sampling with ``max_tokens`` checked against the context."""
        left = self.context - prompt_tokens
        param = "messages" if request.kind == "chat" else "prompt"
        if left < 1:
            raise ApiError(400, f"the prompt has {prompt_tokens} tokens; the model's context is {self.context}",
                           param=param, code="context_length_exceeded")
        wanted = request.max_tokens if request.max_tokens is not None else min(DEFAULT_CHAT_TOKENS, left)
        if wanted > left:
            raise ApiError(400, f"{prompt_tokens} prompt tokens + max_tokens {wanted} exceed the model's context "
                           f"of {self.context} tokens", param="max_tokens", code="context_length_exceeded")
        return replace(request.sampling, max_tokens=wanted)

    def start(self, request: Request, input_ids: list[int], sampling: Sampling,
              adapter: str | None = None) -> Generation:
        """Generate ``request.n`` choices in a worker thread (through ``adapter``, None: the base model); return the
        `Generation` reporting them."""
        with self._lock:
            if self._pending >= self.max_concurrent + self.max_waiting:
                raise ApiError(429, f"too many requests: {self._pending} are generating or waiting",
                               type="rate_limit_error", code="rate_limit_exceeded")
            self._pending += 1
        generation = Generation(asyncio.get_running_loop())
        generation.prompt_tokens = len(input_ids)
        try:
            self.executor.submit(self._work, generation, input_ids, sampling, request.n, adapter)
        except RuntimeError:
            self._release()
            raise ApiError(503, "the server is shutting down", type="server_error") from None
        return generation

    def _release(self) -> None:
        with self._lock:
            self._pending -= 1

    def _work(self, generation: Generation, input_ids: list[int], sampling: Sampling, n: int,
              adapter: str | None) -> None:
        try:
            for index in range(n):
                if generation.cancelled.is_set():
                    break
                seed = None if sampling.seed is None else sampling.seed + index
                stream = stream_text(self.model, self.tokenizer, input_ids, replace(sampling, seed=seed),
                                     self.speculation() if self.speculation is not None else None, adapter)
                generation.streams.append(stream)
                if generation.cancelled.is_set():
                    stream.close()
                    break
                for piece in stream:
                    generation.put(Event("piece", index, piece=piece))
                generation.completion_tokens += stream.completion_tokens
                generation.put(Event("end", index, stream=stream))
            generation.put(Event("done"))
        except Exception as exc:
            generation.put(Event("error", error=swarm_error(exc)))
        finally:
            for stream in generation.streams:
                stream.close()
            self._release()

    @property
    def events_count(self) -> int:
        """Servers caught so far (0 when the model does not verify)."""
        return len(self.verification_events) if self.verification_events is not None else 0

    def verification(self, limit: int = 100) -> dict[str, Any]:
        """The body of ``GET /distconf/verification``: the latest ``limit`` events, oldest first."""
        events = list(self.verification_events or ())
        shown = events[max(0, len(events) - max(0, min(limit, MAX_EVENTS_LISTED))):]
        return {"object": "list", "enabled": self.verification_events is not None and self.verify_fraction > 0,
                "verify_fraction": self.verify_fraction, "total": len(events),
                "data": [e.to_dict() for e in shown]}

    def shutdown(self) -> None:
        """Stop taking requests, end running sessions' threads' work, and close the swarm connection."""
        self.executor.shutdown(wait=False, cancel_futures=True)
