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

With spot checks on (``verify_fraction``, see `distconf.client.verifier`), every step goes
through the client (no server-to-server push), each span keeps a `SpanCheck` and a shadow
session on an independent server, and a check that catches a server goes back to the first
wrong position (`VerificationRollback` when that is before the current step).
"""

from __future__ import annotations

import logging
import math
import uuid
from typing import Any

import torch

from distconf.client.session_checks import check_session
from distconf.client.span_session import SpanSession
from distconf.client.verifier import SpanCheck, VerificationError, VerificationRollback, Verifier
from distconf.dht import RemoteSpan

__all__ = ["InferenceSession", "SpanSession"]

logger = logging.getLogger(__name__)


class InferenceSession:
    """A multi-step inference session over all blocks of the model, with failover.

    :param manager: the `SequenceManager` that routes the session.
    :param max_length: most tokens the session will hold (prompt and generated tokens).
    :param verifier: the client's `Verifier` (spot checks when enabled), or None.
    """

    def __init__(self, manager: Any, max_length: int, dtype: torch.dtype = torch.float32,
                 verifier: Verifier | None = None) -> None:
        self.manager = manager
        self.config = manager.config
        self.verifier = verifier if verifier is not None and verifier.enabled else None
        self.steps = 0
        self.caught: set[str] = set()  # servers caught here: banned until the session ends, then ban_timeout
        self._suspect = math.inf  # results from here on came from a replaced server and cannot be checked
        self._rerouted = False  # a server was replaced during the step: check its first step
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

    @property
    def verified(self) -> int:
        """Positions below this were covered by a spot check on every span (all, without checks)."""
        if self.verifier is None or not self.sessions:
            return self.position if self.verifier is None else 0
        return min(s.check.verified if s.check is not None else self.position for s in self.sessions)

    def verify(self) -> None:
        """Check every position not verified yet, now (e.g. before the last tokens are given out).

        Raises `VerificationRollback` if a server is caught (the session is then back at the
        first wrong position, with the liar replaced). Does nothing without spot checks.
        """
        if self.verifier is None or self.closed or not self.sessions:
            return
        caught = check_session(self, self.steps)
        position = self._rollback_position(caught)
        if position < self.position:
            self._replace(caught, position)
            raise VerificationRollback(position, [event for _, event, _ in caught])

    def open_shadow(self, span: RemoteSpan) -> SpanSession:
        """A session on ``span``'s server that recomputes a span of this session (a checker)."""
        return SpanSession(self.manager, span, self.max_length, self.dtype)

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
        x = hidden_states.detach().cpu().to(self.dtype)
        if self.verifier is None:
            return self._run(x, n_new, hypo_ids).to(hidden_states.device, hidden_states.dtype)
        state = self.manager.state
        for _ in range(2 + (len(state.peers) if state is not None else 1)):  # each repeat bans a server
            start = self.position
            checked = not self.sessions or not all(s.stepped for s in self.sessions) or self.verifier.draw()
            self._rerouted = False
            out = self._run(x, n_new, hypo_ids)
            checked = checked or self._rerouted
            step, self.steps = self.steps, self.steps + 1
            caught = check_session(self, step) if checked or self._suspect < self.position else []
            position = self._rollback_position(caught)
            if position >= self.position:
                return out.to(hidden_states.device, hidden_states.dtype)
            self._replace(caught, position if position < start else start)
            if position < start:
                raise VerificationRollback(position, [event for _, event, _ in caught])
            hypo_ids = None  # applied already: the caches keep the reordered rows
        raise VerificationError(f"the step at position {self.position} kept being computed wrong")

    def _run(self, x: torch.Tensor, n_new: int, hypo_ids: torch.Tensor | None) -> torch.Tensor:
        """Send one step through every span (replacing failed servers); the new positions' outputs."""
        step_id = str(uuid.uuid4())
        index, block, x, failed = self._step_route(x, n_new, hypo_ids, step_id)
        num_blocks = self.manager.num_blocks
        while block < num_blocks:
            index, block, x = self._step_span(index, block, x, n_new, hypo_ids, step_id, failed)
            failed = None
        self.position += n_new
        return x[:, -n_new:]

    def _rollback_position(self, caught: list[tuple[int, Any, bool]]) -> float:
        """The first position whose results are wrong (or unverifiable after a failover); inf if none."""
        position = min([event.position for _, event, _ in caught] + [self._suspect])
        self._suspect = math.inf
        return position

    def _replace(self, caught: list[tuple[int, Any, bool]], position: int) -> None:
        """Go back to ``position`` and replace the caught servers still in the route (highest index first)."""
        self.rewind(position)
        for index in sorted({i for i, _, replace in caught if replace}, reverse=True):
            self._reroute(index, self.sessions[index].span.start, failed=True)

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
        if not self.config.use_server_to_server or self.verifier is not None:
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
        if self.verifier is not None:
            self._rerouted = True
            for session in fresh:
                session.check = SpanCheck()
            if old is not None and old.check is not None:
                if fresh[0].span.end == end:  # the same span: its unverified results are checked later
                    fresh[0].check.inherit(old.check, fresh[0].peer_id)
                elif old.check.verified < self.position:  # split: go back to what was verified
                    self._suspect = min(self._suspect, old.check.verified)
        if old is not None:
            fresh[0].history = old.history
            old.close()
            self.failovers += 1
            logger.info("replacing …%s for blocks %d..%d: %s", old.peer_id[-6:], block, end - 1,
                        ", ".join(f"{s.span.start}:{s.span.end} via …{s.peer_id[-6:]}" for s in fresh))
        self.sessions[index:index + 1] = fresh
        self._name_pushers()

    def _name_pushers(self) -> None:
        """Tell each server which peer alone may push to its session: the server of the span before it."""
        push = bool(self.config.use_server_to_server) and self.verifier is None
        for i, session in enumerate(self.sessions):
            session.push_from = self.sessions[i - 1].peer_id if push and i > 0 else ""

    def close(self) -> None:
        """End the streams on every server."""
        if self.closed:
            return
        self.closed = True
        for s in self.sessions:
            s.close()
        if self.verifier is not None and self.caught:
            self.verifier.release(self.caught)

    def __enter__(self) -> InferenceSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
