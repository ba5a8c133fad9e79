"""``state.continuation`` of a draft: the checker's chunked run says whether the layer continues any step."""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import uuid
from pathlib import Path

from distconf.tools.drafting.render import FamilyDraft

__all__ = ["draft_continuation"]

logger = logging.getLogger(__name__)


def draft_continuation(draft: FamilyDraft) -> None:
    """``continuation: one_token`` when the draft, checked as written, fails only at ``state.continuation``.

    Any other failure of the check becomes a review note (the first one, in one line).

    Mixers that read their state only in one-token decode (selective scans of the first
    kind) continue a multi-token step from scratch: the checker's steps of 4/2/1/2 tokens
    then differ while token-by-token and whole-sequence runs agree.
    """
    from distconf.tools.checker.run import check_family

    # a name of its own: the loader keeps every family it loaded, and the user checks the draft itself later
    probe = dataclasses.replace(draft, family=f"{draft.family}_probe_{uuid.uuid4().hex[:8]}")
    with tempfile.TemporaryDirectory(prefix="distconf-draft-") as folder:
        path = Path(folder) / f"{probe.family}.yaml"
        path.write_text(probe.to_yaml(), encoding="utf-8")
        try:
            results = check_family(path)
        except Exception:  # the user's own `distconf check` reports it
            logger.debug("checking the draft of %s crashed", draft.family, exc_info=True)
            return
    failures = [result.failure for result in results if result.failure is not None]
    fields = {failure.field for failure in failures}
    if fields and fields != {"state.continuation"}:
        first = next(f for f in failures if f.field != "state.continuation")
        message = str(first).replace(str(path), f"{draft.family}.yaml").replace(probe.family, draft.family)
        draft.review.append(f"`distconf check` of this draft fails: {message.splitlines()[0]}")
    elif fields == {"state.continuation"}:
        draft.state["continuation"] = "one_token"
        draft.facts.append("multi-token steps after an earlier state differ from the model while one-token steps "
                           "agree: the layer reads its state only in one-token steps (continuation: one_token)")
