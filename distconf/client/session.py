"""Inference sessions: one ``rpc_inference`` stream per span of the route, with failover.

`InferenceSession.step` sends new hidden states through every span in order. Each
`SpanSession` keeps the inputs it sent (its ``history``, reordered along with the
server's cache when ``hypo_ids`` are given). When a server fails, the session bans it,
routes the failed span's blocks again, opens fresh streams there and replays the
history to them (no ``start_from_position`` for a fresh stream: it starts empty), then
continues. Deep prompts given on the first step are kept and sent with every
message that covers prompt positions (the first step, and a replay after failover).
With ``use_server_to_server`` each step also names the following servers
(``next_servers``) so a server pushes its outputs straight to the next one; the
client's own copy is de-duplicated by ``step_id`` on the server.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import torch

from distconf.dht import RemoteSpan
from distconf.rpc.calls import InferenceStream, inference_step_request
from distconf.rpc.protocol import (
    KEY_ALLOC_TIMEOUT,
    KEY_MAX_LENGTH,
    KEY_NEXT_SERVERS,
    KEY_SESSION_ID,
    KEY_START_FROM_POSITION,
    KEY_STEP_ID,
    deserialize_tensors,
)

__all__ = ["InferenceSession", "SpanSession"]

logger = logging.getLogger(__name__)


class SpanSession:
    """The stream to one server for blocks ``span.start..span.end-1`` of an inference session."""

    def __init__(self, manager: Any, span: RemoteSpan, max_length: int, dtype: torch.dtype) -> None:
        self.manager = manager
        self.swarm = manager.swarm
        self.config = manager.config
        self.span = span
        self.uid = manager.chain_uid(span)
        self.session_id = str(uuid.uuid4())
        self.max_length = max_length
        self.dtype = dtype
        self._buffer: torch.Tensor | None = None  # inputs sent so far in [:, :_length]; grows by doubling
        self._length = 0
        self.position = 0
        self.stepped = False
        self.pending_start: int | None = None
        self.closed = False
        self.wire_dtype: torch.dtype | None = None
        self._stream: InferenceStream | None = None

    @property
    def history(self) -> torch.Tensor | None:
        """The inputs sent so far (all positions), as the server's cache holds them."""
        return None if self._buffer is None else self._buffer[:, :self._length]

    @history.setter
    def history(self, value: torch.Tensor | None) -> None:
        self._buffer, self._length = value, 0 if value is None else int(value.shape[1])

    def _appended(self, sent: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(buffer, length) with ``sent`` written after the history; the history itself is unchanged.

        Amortized: the buffer doubles (up to ``max_length``) instead of being copied every step.
        """
        length, need = self._length, self._length + sent.shape[1]
        buffer = self._buffer
        if buffer is None or buffer.shape[1] < need or buffer.shape[0] != sent.shape[0] or buffer.dtype != sent.dtype:
            capacity = max(need, min(self.max_length, 2 * need))
            grown = sent.new_empty((sent.shape[0], capacity, *sent.shape[2:]))
            if buffer is not None and length:
                grown[:, :length] = buffer[:, :length]
            buffer = grown
        buffer[:, length:need] = sent
        return buffer, need

    @property
    def peer_id(self) -> str:
        """The server's base58 peer id."""
        return self.span.peer_id

    def next_server(self) -> tuple[str, str, int, int]:
        """This span as an entry of ``next_servers``."""
        return (self.peer_id, self.session_id, self.span.start, self.span.end)

    # ------------------------------------------------------------------ stream plumbing (event loop)
    async def _exchange(self, request: Any) -> Any:
        if self._stream is None:
            self._stream = await InferenceStream.open(self.swarm.p2p, self.peer_id,
                                                      timeout=float(self.config.connect_timeout))
        try:
            return await self._stream.step(request, timeout=float(self.config.request_timeout))
        except EOFError:
            raise ConnectionError(f"server …{self.peer_id[-6:]} closed the inference stream") from None

    async def _close(self) -> None:
        if self._stream is not None:
            await self._stream.close(timeout=2.0)  # empty request: end of session

    # ------------------------------------------------------------------ one step
    def step(self, inputs: torch.Tensor, n_new: int, position: int, hypo_ids: torch.Tensor | None,
             step_id: str, next_servers: list[tuple[str, str, int, int]],
             prompts: torch.Tensor | None = None) -> torch.Tensor:
        """Send this step; return the outputs for what was sent (all positions when replaying).

        ``inputs`` holds either the ``n_new`` new positions or all ``position + n_new``.
        ``prompts``: the session's deep prompts for all blocks (sliced to this span here).
        """
        request, commit = self._prepare(inputs, n_new, position, hypo_ids, step_id, next_servers, prompts)
        timeout = float(self.config.connect_timeout) + float(self.config.request_timeout) + 1.0
        return commit(self.swarm.run(self._exchange(request), timeout=timeout))

    async def astep(self, inputs: torch.Tensor, n_new: int, position: int, hypo_ids: torch.Tensor | None,
                    step_id: str, next_servers: list[tuple[str, str, int, int]],
                    prompts: torch.Tensor | None = None) -> torch.Tensor:
        """`step` on the event loop (for a span that has stepped already: nothing here blocks)."""
        request, commit = self._prepare(inputs, n_new, position, hypo_ids, step_id, next_servers, prompts)
        return commit(await self._exchange(request))

    def _prepare(self, inputs: torch.Tensor, n_new: int, position: int, hypo_ids: torch.Tensor | None,
                 step_id: str, next_servers: list[tuple[str, str, int, int]], prompts: torch.Tensor | None
                 ) -> tuple[Any, Any]:
        """The step's request and the function that checks its reply and commits the step."""
        if self.closed:
            raise RuntimeError("span session is closed")
        if self.stepped:
            if self.position != position:
                raise RuntimeError(f"span at position {self.position}, session at {position}")
            sent = inputs[:, -n_new:]
            if hypo_ids is None:
                buffer, length = self._appended(sent)
            else:
                history = self.history if self.history is not None else sent[:, :0]
                buffer = torch.cat([history[hypo_ids], sent], dim=1)
                length = buffer.shape[1]
            step_hypo = hypo_ids
        else:
            if inputs.shape[1] == position + n_new:
                sent = inputs
            else:
                if self.history is None or self.history.shape[1] < position:
                    raise RuntimeError(f"no history to replay {position} positions to a new server")
                history = self.history[:, :position]
                if hypo_ids is not None:
                    history = history[hypo_ids]
                sent = torch.cat([history, inputs[:, -n_new:]], dim=1)
            buffer, length = sent, sent.shape[1]
            step_hypo = None  # a fresh cache is filled with the already reordered history
        metadata = self._step_metadata(step_id, next_servers)
        if self.wire_dtype is None:
            self.wire_dtype = self.manager.server_dtype(self.span) or self.dtype
        first = position + n_new - sent.shape[1]  # absolute position of sent[:, 0]
        span_prompts = None
        if prompts is not None and first < prompts.shape[2]:
            span_prompts = prompts[self.span.start:self.span.end]
        request = inference_step_request(self.uid, sent, span_prompts, hypo_ids=step_hypo, metadata=metadata,
                                         dtype=self.wire_dtype)

        def commit(response: Any) -> torch.Tensor:
            outputs = deserialize_tensors(response.tensors[:1])
            if not outputs or tuple(outputs[0].shape) != tuple(sent.shape):
                got = tuple(outputs[0].shape) if outputs else "nothing"
                raise ConnectionError(f"server …{self.peer_id[-6:]} returned {got} for inputs {tuple(sent.shape)}")
            self._buffer, self._length = buffer, length
            self.position = position + n_new
            self.stepped = True
            self.pending_start = None
            return outputs[0].to(inputs.dtype)

        return request, commit

    def _step_metadata(self, step_id: str, next_servers: list[tuple[str, str, int, int]]) -> dict[str, Any]:
        metadata: dict[str, Any] = {KEY_SESSION_ID: self.session_id, KEY_STEP_ID: step_id}
        if not self.stepped:
            metadata.update({
                KEY_MAX_LENGTH: self.max_length,
                KEY_ALLOC_TIMEOUT: float(self.config.request_timeout),
                **self.manager.request_metadata(),  # active_adapter, points
            })
        elif self.pending_start is not None:
            metadata[KEY_START_FROM_POSITION] = self.pending_start
        if next_servers and self.stepped:
            metadata[KEY_NEXT_SERVERS] = [list(s) for s in next_servers]
        return metadata

    def rewind(self, position: int) -> None:
        """Forget positions from ``position`` on (sent as ``start_from_position`` on the next step)."""
        self._length = min(self._length, position)
        if self.stepped and position < self.position:
            self.position = position
            self.pending_start = position

    def close(self) -> None:
        """End the stream (the server frees this session's cache)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.swarm.run(self._close(), timeout=5.0)
        except Exception as exc:
            logger.debug("closing session on …%s: %r", self.peer_id[-6:], exc)


class InferenceSession:
    """A multi-step inference session over all blocks of the model, with failover.

    :param manager: the `SequenceManager` that routes the session.
    :param max_length: most tokens the session will hold (prompt and generated tokens).
    """

    def __init__(self, manager: Any, max_length: int, dtype: torch.dtype = torch.float32) -> None:
        self.manager = manager
        self.config = manager.config
        self.max_length = int(max_length)
        self.dtype = dtype
        self.position = 0
        self.sessions: list[SpanSession] = []
        self.closed = False
        self.failovers = 0
        self.prompts: torch.Tensor | None = None

    @property
    def route(self) -> list[RemoteSpan]:
        """The spans of the sessions currently in use."""
        return [s.span for s in self.sessions]

    def rewind(self, position: int) -> None:
        """Go back to ``position`` (the next step overwrites what came after it)."""
        if not 0 <= position <= self.position:
            raise ValueError(f"cannot rewind a session at {self.position} to {position}")
        for s in self.sessions:
            s.rewind(position)
        self.position = position

    def step(self, hidden_states: torch.Tensor, hypo_ids: torch.Tensor | None = None,
             prompts: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``[batch, new_tokens, hidden]`` through every block; return the last block's outputs.

        ``prompts``: deep prompts ``[num_blocks, batch or 1, pre_seq_len, hidden]``, given on the
        first step (which must cover the prompt positions); the session keeps them for replays.
        """
        if self.closed:
            raise RuntimeError("the inference session is closed")
        n_new = int(hidden_states.shape[1])
        if prompts is not None:
            if self.position != 0 or prompts.shape[2] > n_new:
                raise ValueError(f"deep prompts for {prompts.shape[2]} positions must come with the first step "
                                 f"and be covered by it (session at {self.position}, {n_new} new positions)")
            self.prompts = prompts.detach().cpu().to(self.dtype)
        if self.position + n_new > self.max_length:
            raise ValueError(f"session max_length {self.max_length} exceeded: {self.position} tokens + {n_new} new")
        if hypo_ids is not None:
            hypo_ids = hypo_ids.to("cpu", torch.int64)
            if hypo_ids.shape != (hidden_states.shape[0],):
                raise ValueError(f"hypo_ids must have shape ({hidden_states.shape[0]},), got {tuple(hypo_ids.shape)}")
        step_id = str(uuid.uuid4())
        x = hidden_states.detach().cpu().to(self.dtype)
        index, block, x, failed = self._step_route(x, n_new, hypo_ids, step_id)
        num_blocks = self.manager.num_blocks
        while block < num_blocks:
            index, block, x = self._step_span(index, block, x, n_new, hypo_ids, step_id, failed)
            failed = None
        self.position += n_new
        return x[:, -n_new:].to(hidden_states.device, hidden_states.dtype)

    def _step_route(self, x: torch.Tensor, n_new: int, hypo_ids: torch.Tensor | None, step_id: str
                    ) -> tuple[int, int, torch.Tensor, Exception | None]:
        """Run the step through the current route in one call on the event loop (the common case).

        One hand-off to the loop thread per step instead of one per span. Returns the span
        index and block reached, the hidden states there and, if that span failed, its error
        (the caller retries from there as `_step_span` does). Does nothing for a route that is
        not set up yet.
        """
        sessions = list(self.sessions)
        if not sessions or sessions[-1].span.end != self.manager.num_blocks or \
                not all(s.stepped and not s.closed for s in sessions):
            return 0, 0, x, None
        position, prompts = self.position, self.prompts

        async def run_all() -> tuple[int, torch.Tensor, Exception | None]:
            y = x
            for i, session in enumerate(sessions):
                try:
                    y = await session.astep(y, n_new, position, hypo_ids, step_id, self._next_servers(i), prompts)
                except Exception as exc:
                    return i, y, exc
            return len(sessions), y, None

        bound = len(sessions) * (float(self.config.request_timeout) + 1.0) + float(self.config.connect_timeout)
        done, y, error = self.manager.swarm.run(run_all(), timeout=bound)
        for session in sessions[:done]:
            self.manager.on_success(session.peer_id)
        if error is None:
            return done, sessions[-1].span.end, y, None
        self.manager.on_failure(sessions[done].peer_id, error)
        return done, sessions[done].span.start, y, error

    def _step_span(self, index: int, block: int, x: torch.Tensor, n_new: int, hypo_ids: torch.Tensor | None,
                   step_id: str, failed: Exception | None = None) -> tuple[int, int, torch.Tensor]:
        """Run span ``index`` (starting at ``block``), replacing its server as often as retries allow.

        ``failed``: the error of a first attempt already made (by `_step_route`): retries go on from it.
        """

        def attempt(n: int) -> tuple[int, int, torch.Tensor]:
            if n == 0 and failed is not None:
                raise failed
            if index >= len(self.sessions) or n > 0:
                self._reroute(index, block, failed=n > 0)
            session = self.sessions[index]
            try:
                out = session.step(x, n_new, self.position, hypo_ids, step_id, self._next_servers(index),
                                   self.prompts)
            except Exception as exc:
                self.manager.on_failure(session.peer_id, exc)
                raise
            self.manager.on_success(session.peer_id)
            return index + 1, session.span.end, out

        return self.manager.with_retries(f"inference step at block {block}", attempt)

    def _next_servers(self, index: int) -> list[tuple[str, str, int, int]]:
        if not self.config.use_server_to_server:
            return []
        chain = []
        for s in self.sessions[index + 1:]:
            if not s.stepped or s.closed:
                break
            chain.append(s.next_server())
        return chain

    def _reroute(self, index: int, block: int, failed: bool) -> None:
        """Open sessions for blocks ``block..`` (to the end, or to the end of the failed span)."""
        old = self.sessions[index] if index < len(self.sessions) else None
        end = old.span.end if old is not None else self.manager.num_blocks
        route = self.manager.plan_route(block, end, inference=True, cache_tokens_needed=self.max_length)
        fresh = [SpanSession(self.manager, span, self.max_length, self.dtype) for span in route]
        if old is not None:
            fresh[0].history = old.history
            old.close()
            self.failovers += 1
            logger.info("replacing …%s for blocks %d..%d: %s", old.peer_id[-6:], block, end - 1,
                        ", ".join(f"{s.span.start}:{s.span.end} via …{s.peer_id[-6:]}" for s in fresh))
        self.sessions[index:index + 1] = fresh

    def close(self) -> None:
        """End the streams on every server."""
        if self.closed:
            return
        self.closed = True
        for s in self.sessions:
            s.close()

    def __enter__(self) -> InferenceSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
