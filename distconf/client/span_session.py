"""`SpanSession`: the ``rpc_inference`` stream to one server for one span of an inference session.

It keeps the inputs it sent (its ``history``, reordered along with the server's cache when
``hypo_ids`` are given) so a replacement server can be given them again, and, with spot
checks on, the `SpanCheck` of what its server answered.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import torch

from distconf.client.reply_checks import checked_reply, max_reply_bytes
from distconf.client.verifier import SpanCheck
from distconf.dht import RemoteSpan
from distconf.rpc.calls import InferenceStream, inference_step_request
from distconf.rpc.protocol import (
    KEY_ALLOC_TIMEOUT,
    KEY_MAX_LENGTH,
    KEY_NEXT_SERVERS,
    KEY_PUSH_FROM,
    KEY_SESSION_ID,
    KEY_START_FROM_POSITION,
    KEY_STEP_ID,
)

__all__ = ["SpanSession"]

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
        self.compression = 0  # the hivemind compression the server asks for (its rpc_info schema)
        self.check: SpanCheck | None = None  # with spot checks: what a check compares (not for shadows)
        self.push_from = ""  # the only peer the server may take pushes from for this session ("": none)
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
    async def _exchange(self, request: Any, max_bytes: int) -> Any:
        if self._stream is None:
            self._stream = await InferenceStream.open(self.swarm.p2p, self.peer_id,
                                                      timeout=float(self.config.connect_timeout))
        try:
            return await self._stream.step(request, timeout=float(self.config.request_timeout),
                                           max_reply_bytes=max_bytes)
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
        request, commit, limit = self._prepare(inputs, n_new, position, hypo_ids, step_id, next_servers, prompts)
        timeout = float(self.config.connect_timeout) + float(self.config.request_timeout) + 1.0
        return commit(self.swarm.run(self._exchange(request, limit), timeout=timeout))

    async def astep(self, inputs: torch.Tensor, n_new: int, position: int, hypo_ids: torch.Tensor | None,
                    step_id: str, next_servers: list[tuple[str, str, int, int]],
                    prompts: torch.Tensor | None = None) -> torch.Tensor:
        """`step` on the event loop (for a span that has stepped already: nothing here blocks)."""
        request, commit, limit = self._prepare(inputs, n_new, position, hypo_ids, step_id, next_servers, prompts)
        return commit(await self._exchange(request, limit))

    def _prepare(self, inputs: torch.Tensor, n_new: int, position: int, hypo_ids: torch.Tensor | None,
                 step_id: str, next_servers: list[tuple[str, str, int, int]], prompts: torch.Tensor | None
                 ) -> tuple[Any, Any, int]:
        """The step's request, the function that checks its reply and commits the step, the reply's size cap."""
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
            self.compression = self.manager.server_compression(self.span)
        first = position + n_new - sent.shape[1]  # absolute position of sent[:, 0]
        span_prompts = None
        if prompts is not None and first < prompts.shape[2]:
            span_prompts = prompts[self.span.start:self.span.end]
        request = inference_step_request(self.uid, sent, span_prompts, hypo_ids=step_hypo, metadata=metadata,
                                         dtype=self.wire_dtype, compression=self.compression)

        def commit(response: Any) -> torch.Tensor:
            output = checked_reply(response.tensors, sent.shape, f"server …{self.peer_id[-6:]}")
            self._buffer, self._length = buffer, length
            self.position = position + n_new
            self.stepped = True
            self.pending_start = None
            result = output.to(inputs.dtype)
            if self.check is not None:
                self.check.record(first, result, step_hypo, self.peer_id)
            return result

        return request, commit, max_reply_bytes(sent.shape)

    def _step_metadata(self, step_id: str, next_servers: list[tuple[str, str, int, int]]) -> dict[str, Any]:
        metadata: dict[str, Any] = {KEY_SESSION_ID: self.session_id, KEY_STEP_ID: step_id,
                                    KEY_PUSH_FROM: self.push_from}
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
        if self.check is not None:
            self.check.rewind(position)

    def close(self) -> None:
        """End the stream (the server frees this session's cache)."""
        if self.closed:
            return
        self.closed = True
        if self.check is not None:
            self.check.drop_shadow()
        try:
            self.swarm.run(self._close(), timeout=5.0)
        except Exception as exc:
            logger.debug("closing session on …%s: %r", self.peer_id[-6:], exc)
