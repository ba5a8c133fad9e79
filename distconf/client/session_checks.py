"""One check of an inference session: every span's shadow catches up, and the results are compared.

See `distconf.client.verifier` for the policy. `check_session` runs the catch-up calls of
all spans at once on the event loop (a check costs about one span's round trip, however
many spans the route has), retries a span whose checker failed on another checker, and
settles mismatches with `Verifier.arbitrate`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import uuid
from typing import Any

import torch

from distconf.client.span_calls import forward_span
from distconf.client.verifier import VerificationError
from distconf.client.verify_compare import update_difference
from distconf.client.verify_events import VerificationEvent

__all__ = ["check_session"]

logger = logging.getLogger(__name__)

_CHECKER_ATTEMPTS = 3


async def _catch_up(span_session: Any, position: int, prompts: torch.Tensor | None) -> tuple[int, torch.Tensor]:
    """Send the shadow of ``span_session`` every input from its position to ``position``; its outputs."""
    check = span_session.check
    shadow = check.shadow
    start = shadow.position if shadow.stepped else 0
    inputs = span_session.history[:, start:position]
    hypo_ids = check.perm if shadow.stepped else None
    out = await shadow.astep(inputs, position - start, start, hypo_ids, str(uuid.uuid4()), [], prompts)
    check.perm = None
    return start, out


def _open_shadows(session: Any, todo: list[tuple[int, Any]], failed: set[str]) -> None:
    verifier, manager = session.verifier, session.manager
    for _, span_session in todo:
        check = span_session.check
        if check.shadow is not None:
            continue
        span = span_session.span
        candidates = verifier.candidates(span, {span_session.peer_id} | failed, manager)
        if not candidates:
            raise VerificationError(
                f"no independent server of the same dtype and quantization holds blocks {span.start}..{span.end - 1} "
                f"to check …{span_session.peer_id[-6:]} (verify_fraction={verifier.fraction}; set it to 0 to run "
                f"unchecked)")
        check.shadow, check.perm = session.open_shadow(candidates[0]), None
        check.shadow.wire_dtype = manager.server_dtype(check.shadow.span) or session.dtype


def _shadow_outputs(session: Any, pending: list[tuple[int, Any]]) -> dict[int, tuple[int, torch.Tensor]]:
    """``{span index: (first position, shadow outputs)}`` for every pending span (or `VerificationError`)."""
    manager, position = session.manager, session.position
    results: dict[int, tuple[int, torch.Tensor]] = {}
    failed: set[str] = set()
    for _ in range(_CHECKER_ATTEMPTS):
        todo = [(i, s) for i, s in pending if i not in results]
        if not todo:
            break
        _open_shadows(session, todo, failed)

        async def run_all(todo: list[tuple[int, Any]] = todo) -> list[Any]:
            return await asyncio.gather(*(_catch_up(s, position, session.prompts) for _, s in todo),
                                        return_exceptions=True)

        bound = float(session.config.connect_timeout) + float(session.config.request_timeout) + 2.0
        for (i, span_session), outcome in zip(todo, manager.swarm.run(run_all(), timeout=bound), strict=True):
            if isinstance(outcome, BaseException):
                peer = span_session.check.shadow.peer_id
                logger.debug("checker …%s failed: %r", peer[-6:], outcome)
                manager.on_failure(peer, outcome)
                failed.add(peer)
                span_session.check.drop_shadow()
            else:
                results[i] = outcome
    missing = [s.span for i, s in pending if i not in results]
    if missing:
        raise VerificationError(f"no checker answered for blocks {missing[0].start}..{missing[0].end - 1} "
                                f"after {_CHECKER_ATTEMPTS} attempts")
    return results


def check_session(session: Any, step: int) -> list[tuple[int, VerificationEvent, bool]]:
    """Check every span of ``session`` with positions not yet verified; return the servers caught.

    Returns ``(span index, event, replace)`` for each span whose results were wrong (the
    server that gave them banned for the session, the event recorded); the caller goes back
    to ``event.position`` and, when ``replace``, replaces the span's server (false when the
    wrong results came from a server the span has already replaced). A checker caught lying
    instead is banned and dropped, and its span counts as verified (a third server confirmed it).
    """
    verifier, position = session.verifier, session.position
    pending = [(i, s) for i, s in enumerate(session.sessions) if s.check is not None and s.check.verified < position]
    if not pending:
        return []
    verifier.checks += 1
    caught: list[tuple[int, VerificationEvent, bool]] = []
    for i, (start, out) in _shadow_outputs(session, pending).items():
        span_session = session.sessions[i]
        check = span_session.check
        first = max(check.verified, start)
        primary = check.unverified(first, position)
        if primary is None:
            logger.debug("no outputs held for positions %d..%d of span %d", first, position - 1, i)
            check.passed(position)
            continue
        checked = out[:, first - start:].to(primary.dtype)
        inputs = span_session.history
        tolerance = verifier.tolerance(span_session.wire_dtype, check.shadow.wire_dtype)
        if bool((update_difference(inputs[:, first:position], checked, primary) <= tolerance).all()):
            check.passed(position)
            continue
        checker = check.shadow.peer_id
        history = inputs[:, :position]

        def recompute(third: Any, history: torch.Tensor = history, first: int = first) -> torch.Tensor:
            return forward_span(session.manager, third, history, session.prompts)[:, first:]

        verdict = verifier.arbitrate(span_session.span, checker, recompute, history[:, first:], first, primary,
                                     checked, step=step, kind="inference", tolerance=tolerance,
                                     manager=session.manager)
        event = verdict.event
        if verdict.primary_guilty:
            owner = check.owner(event.position) or span_session.peer_id
            event = dataclasses.replace(event, peer_id=owner)
        verifier.ban(event.peer_id, until=math.inf)
        session.caught.add(event.peer_id)
        verifier.record(event)
        if verdict.primary_guilty:
            caught.append((i, event, event.peer_id == span_session.peer_id))
        else:
            check.drop_shadow()
            check.passed(position)
    return caught
