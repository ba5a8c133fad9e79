"""Spot checks: independent servers recompute a share of a client's span results; liars are caught and banned.

With ``verify_fraction`` f > 0 the client trusts no single server:

* **Inference.** Each span of a session has a *shadow*: an inference session on another
  server of the same blocks (`SpanCheck`). A checked step makes every shadow catch up on
  all the inputs its span got since the previous check, in one call, and compares the
  outputs of all those positions with what the span's server answered
  (`distconf.client.verify_compare.update_difference` against the tolerance): one check
  covers every step since the previous one. The first step on a server is always checked,
  then each step with probability f (drawn from the OS's random source, so a server cannot
  predict it; steps are sent through the client only, no server-to-server push, so all steps
  look alike to the server).
* **Forward calls** (`RemoteSequential` without a session) are recomputed on another
  server with probability f.
* **A mismatch** is settled by a third server (`Verifier.arbitrate`): the side it agrees with
  is honest. The other server is banned (for the rest of the session, then ``ban_timeout``),
  a `VerificationEvent` is recorded (`Verifier.events`, logged at WARNING, passed to
  `Verifier.listeners`) and the honest results are used: an inference session goes back to
  the first wrong position (`VerificationRollback` when that is before the current step).
  When no independent server exists, or three disagree, `VerificationError` says so.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from distconf.client.span_calls import backward_span, forward_span
from distconf.client.verify_compare import tolerance_for, update_difference
from distconf.client.verify_events import VerificationEvent
from distconf.dht import RemoteSpan, ServerState

__all__ = ["Verifier", "SpanCheck", "VerificationError", "VerificationRollback", "Verdict"]

logger = logging.getLogger(__name__)


class VerificationError(RuntimeError):
    """A span's results cannot be verified: no independent server holds its blocks, or servers disagree
    with no majority."""


class VerificationRollback(RuntimeError):
    """A check found wrong results at ``position``, before the current step.

    The session has gone back to ``position`` (the liar is banned and replaced): give it the
    tokens from ``position`` on again. ``events`` are the detections that caused it.
    """

    def __init__(self, position: int, events: list[VerificationEvent]) -> None:
        super().__init__(f"wrong results from position {position} on: the session went back to it "
                         f"({'; '.join(e.describe() for e in events)})")
        self.position = position
        self.events = events


@dataclasses.dataclass
class Verdict:
    """The outcome of a disagreement between a checked server and its checker.

    ``guilty``: the peer whose results the third server does not confirm; ``primary_guilty``
    whether that is the checked server; ``event`` the evidence.
    """

    guilty: str
    primary_guilty: bool
    event: VerificationEvent


class SpanCheck:
    """The check state of one span of an inference session (owned by its `SpanSession`).

    ``verified``: positions below it were covered by a check. ``outputs``: the results the
    span's servers gave for the positions from ``verified`` on, as ``(first position, tensor,
    peer id)`` chunks in the session's current row order: the results the next spans were
    given, so after a failover the replaced server's results stay here until checked
    (`inherit`). ``shadow``: the checker's session (or None), and ``perm``: the row reordering
    (``hypo_ids``) the shadow has not been sent yet.
    """

    def __init__(self) -> None:
        self.verified = 0
        self.outputs: list[tuple[int, torch.Tensor, str]] = []
        self.shadow: Any = None
        self.perm: torch.Tensor | None = None

    @property
    def held(self) -> int:
        """One past the last position whose result is held (``verified`` if none is)."""
        return max([f + t.shape[1] for f, t, _ in self.outputs], default=self.verified)

    def record(self, first: int, outputs: torch.Tensor, hypo_ids: torch.Tensor | None, peer_id: str) -> None:
        """``peer_id`` answered ``outputs`` for positions ``first..``, after reordering rows by ``hypo_ids``.

        Positions already held keep their result (a replacement server replays the history:
        the next spans were given the replaced server's results, and those are what a check
        must see).
        """
        if hypo_ids is not None:
            self.outputs = [(f, t[hypo_ids], p) for f, t, p in self.outputs]
            self.perm = hypo_ids if self.perm is None else self.perm[hypo_ids]
        start = max(first, self.held)
        if start < first + outputs.shape[1]:
            self.outputs.append((start, outputs[:, start - first:].detach(), peer_id))

    def inherit(self, old: SpanCheck, peer_id: str) -> None:
        """Take over the state of the check of a replaced server of the same span (now served by ``peer_id``)."""
        self.verified, self.outputs = old.verified, list(old.outputs)
        if old.shadow is not None and old.shadow.peer_id != peer_id:  # a checker must stay independent
            self.shadow, self.perm = old.shadow, old.perm
            old.shadow, old.perm = None, None

    def rewind(self, position: int) -> None:
        """Forget positions from ``position`` on (the shadow too)."""
        self.verified = min(self.verified, position)
        self.outputs = [(f, t[:, :position - f], p) for f, t, p in self.outputs if f < position]
        if self.shadow is not None:
            self.shadow.rewind(position)

    def unverified(self, start: int, end: int) -> torch.Tensor | None:
        """The results held for positions ``start..end-1`` (None if not all are held)."""
        pieces, at = [], start
        for f, t, _ in self.outputs:
            if f <= at < f + t.shape[1]:
                piece = t[:, at - f:min(end, f + t.shape[1]) - f]
                pieces.append(piece)
                at += piece.shape[1]
        return torch.cat(pieces, dim=1) if at >= end and pieces else None

    def owner(self, position: int) -> str | None:
        """The peer whose result for ``position`` is held."""
        return next((p for f, t, p in self.outputs if f <= position < f + t.shape[1]), None)

    def passed(self, position: int) -> None:
        """Positions below ``position`` are verified."""
        self.verified = max(self.verified, position)
        self.outputs = [(max(f, position), t[:, max(0, position - f):], p) for f, t, p in self.outputs
                        if f + t.shape[1] > position]

    def drop_shadow(self) -> None:
        """Close the shadow (a new one is opened at the next check)."""
        if self.shadow is not None:
            self.shadow.close()
            self.shadow, self.perm = None, None


class Verifier:
    """The spot checks of one client (all its sessions and calls): policy, checkers, verdicts, events.

    :param manager: the client's `SequenceManager` (swarm state, bans, calls).
    """

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.config = manager.config
        self.fraction = float(getattr(self.config, "verify_fraction", 0.0) or 0.0)
        self.configured_tolerance = getattr(self.config, "verify_tolerance", None)
        self.events: list[VerificationEvent] = []
        self.listeners: list[Callable[[VerificationEvent], None]] = []
        self.checks = 0
        self._random = random.SystemRandom()
        self._calls = 0  # forward and backward calls seen (an event's step for them)

    @property
    def enabled(self) -> bool:
        """Whether spot checks are on (``verify_fraction > 0``)."""
        return self.fraction > 0

    def draw(self) -> bool:
        """Whether to check this step or call (true with probability ``verify_fraction``)."""
        return self.enabled and self._random.random() < self.fraction

    def tolerance(self, *dtypes: torch.dtype | None) -> float:
        """The tolerance for results computed in ``dtypes`` (the coarsest; ``verify_tolerance`` if set)."""
        return max(tolerance_for(d, self.configured_tolerance) for d in dtypes or (None,))

    # ------------------------------------------------------------------ servers
    def candidates(self, span: RemoteSpan, exclude: set[str], manager: Any = None) -> list[RemoteSpan]:
        """Independent servers of ``span``'s blocks, in random order, each as a span over exactly those blocks.

        They are ONLINE, usable (allowed, not blocked, not refused by the weights manifest),
        not banned, not in ``exclude``, and announce the same compute dtype and quantization
        as ``span``'s server: honest servers of different forms differ by more than the
        tolerance (a bfloat16 server from a float32 one by up to ~0.3), so only like is
        compared with like. ``manager``: the session's (its adapter's servers only; default the client's).
        """
        manager = manager or self.manager
        state = manager.update()
        banned = manager.banned() | exclude
        form = _form(span)
        found: dict[str, RemoteSpan] = {}
        for other in state.spans:
            if other.start <= span.start and other.end >= span.end and other.peer_id not in banned and \
                    other.peer_id not in found and other.state == ServerState.ONLINE and _form(other) == form and \
                    manager.usable(other):
                found[other.peer_id] = dataclasses.replace(other, start=span.start, end=span.end)
        spans = list(found.values())
        self._random.shuffle(spans)
        return spans

    def ban(self, peer_id: str, *, until: float = math.inf) -> None:
        """Leave ``peer_id`` out of this client's routes until ``until`` (monotonic; default: until `release`)."""
        self.manager.ban(peer_id, until)

    def release(self, peers: set[str]) -> None:
        """End the session-long bans of ``peers``: they stay banned for ``ban_timeout`` more seconds."""
        until = time.monotonic() + float(self.config.ban_timeout)
        for peer in peers:
            self.manager.lift_ban(peer, unless_after=until, until=until)

    def record(self, event: VerificationEvent) -> None:
        """Keep ``event``, log it at WARNING and pass it to every listener (a failing listener is logged)."""
        self.events.append(event)
        logger.warning("verification: %s", event.describe())
        for listener in list(self.listeners):
            try:
                listener(event)
            except Exception as exc:  # a listener must not break a generation
                logger.warning("verification listener %r failed: %r", listener, exc)

    # ------------------------------------------------------------------ settling a disagreement
    def arbitrate(self, span: RemoteSpan, checker: str, recompute: Callable[[RemoteSpan], torch.Tensor],
                  base: torch.Tensor, first: int, primary: torch.Tensor, checked: torch.Tensor, *, step: int,
                  kind: str, tolerance: float, manager: Any = None) -> Verdict:
        """Ask a third server which of ``span``'s server and ``checker`` computed positions ``first..`` right.

        ``recompute(third)``: the third server's result for those positions (for a session, a
        one-shot ``rpc_forward`` of the whole history); ``base``: what differences are measured
        against (the span's inputs there, `update_difference`; zeros for gradients); ``primary``
        and ``checked``: the two results. Raises `VerificationError` when no third server can
        answer or when it agrees with neither. ``manager``: the session's (see `candidates`).
        """
        tried: set[str] = {span.peer_id, checker}
        for third in self.candidates(span, tried, manager)[:3]:
            tried.add(third.peer_id)
            try:
                reference = recompute(third)
            except Exception as exc:
                self.manager.on_failure(third.peer_id, exc)
                logger.debug("third server …%s failed: %r", third.peer_id[-6:], exc)
                continue
            to_primary = update_difference(base, reference, primary)
            to_checker = update_difference(base, reference, checked)
            primary_ok = bool((to_primary <= tolerance).all())
            checker_ok = bool((to_checker <= tolerance).all())
            if primary_ok == checker_ok:
                break
            wrong = to_checker if primary_ok else to_primary
            guilty = checker if primary_ok else span.peer_id
            witness = span.peer_id if primary_ok else checker
            column = int((wrong > tolerance).any(dim=0).nonzero()[0])
            event = VerificationEvent(
                peer_id=guilty, start=span.start, end=span.end, step=step, position=first + column,
                difference=float(wrong.max()), tolerance=tolerance, checkers=(witness, third.peer_id),
                kind=kind)  # type: ignore[arg-type]
            return Verdict(guilty=guilty, primary_guilty=not primary_ok, event=event)
        raise VerificationError(
            f"servers …{span.peer_id[-6:]} and …{checker[-6:]} disagree on blocks {span.start}..{span.end - 1} "
            f"and no third server settles it (asked: {len(tried) - 2})")

    # ------------------------------------------------------------------ forward and backward calls
    def check_call(self, span: RemoteSpan, compute: Callable[[RemoteSpan], torch.Tensor], base: torch.Tensor,
                   out: torch.Tensor, kind: str) -> torch.Tensor:
        """``out`` (``span``'s result), or the honest result if a spot check catches the server.

        ``compute(server)``: the same call to another server (``rpc_forward`` or ``rpc_backward``);
        ``base``: what differences are measured against (the inputs for hidden states, zeros for
        gradients). Checked with probability ``verify_fraction``.
        """
        self._calls += 1
        if not self.draw():
            return out
        self.checks += 1
        for checker in self.candidates(span, {span.peer_id})[:3]:
            try:
                checked = compute(checker)
            except Exception as exc:
                self.manager.on_failure(checker.peer_id, exc)
                continue
            tolerance = self.tolerance(self.manager.server_dtype(span), self.manager.server_dtype(checker))
            if bool((update_difference(base, checked, out) <= tolerance).all()):
                return out
            verdict = self.arbitrate(span, checker.peer_id, compute, base, 0, out, checked,
                                     step=self._calls - 1, kind=kind, tolerance=tolerance)
            self.ban(verdict.guilty, until=time.monotonic() + float(self.config.ban_timeout))
            self.record(verdict.event)
            return checked if verdict.primary_guilty else out
        raise VerificationError(f"no independent server of the same form ({_form(span)[0]}, {_form(span)[1]}) "
                                f"can check blocks {span.start}..{span.end - 1} (verify_fraction={self.fraction}; "
                                f"set it to 0 to run unchecked)")

    def check_forward(self, span: RemoteSpan, x: torch.Tensor, out: torch.Tensor, prompts: torch.Tensor | None
                      ) -> torch.Tensor:
        """`check_call` for a ``rpc_forward`` of ``x`` (with deep ``prompts``) that answered ``out``."""
        return self.check_call(span, lambda server: forward_span(self.manager, server, x, prompts), x, out, "forward")

    def check_backward(self, span: RemoteSpan, inputs: torch.Tensor, grad: torch.Tensor,
                       prompts: torch.Tensor | None, out: list[torch.Tensor]) -> list[torch.Tensor]:
        """`check_call` for a ``rpc_backward`` reply ``out`` (the inputs' gradient, then the deep prompts')."""
        if not out:
            return out

        def compute(server: RemoteSpan) -> torch.Tensor:
            return _joined(backward_span(self.manager, server, inputs, grad, prompts), len(out))

        joined = _joined(out, len(out))
        honest = self.check_call(span, compute, torch.zeros_like(joined), joined, "backward")
        if honest is joined:
            return out
        return [honest[0, i, :t.numel()].reshape(t.shape).to(t.dtype) for i, t in enumerate(out)]


def _joined(grads: list[torch.Tensor], count: int) -> torch.Tensor:
    """A backward reply as one ``[1, tensors, n]`` tensor, each tensor flattened into a row (padded with zeros),
    so each is compared on its own (`update_difference` per row)."""
    if len(grads) != count:
        raise ConnectionError(f"a backward reply of {len(grads)} tensors, {count} expected")
    joined = torch.zeros(1, count, max(g.numel() for g in grads))
    for i, g in enumerate(grads):
        joined[0, i, :g.numel()] = g.detach().float().reshape(-1)
    return joined


def _form(span: RemoteSpan) -> tuple[str | None, str | None]:
    """The compute dtype and quantization ``span``'s server announces (what results are comparable by)."""
    return span.info.torch_dtype, span.info.quant_type
