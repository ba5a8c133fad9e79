"""Shrinking rotary-embedding parameters (``rope_scaling`` / ``rope_parameters``) with the tiny positions."""

from __future__ import annotations

from typing import Any

from distconf.tools.drafting.common import is_int
from distconf.tools.drafting.profile import Scale

__all__ = ["shrink_rope"]


def shrink_rope(rope: Any, scale: Scale, review: list[str]) -> Any:
    """A rope mapping for the tiny model.

    The original context length shrinks with the tiny positions, keeping the scaling
    factor (at most 4). Per-frequency values (lists, whose length depends on the head
    size) are not scaled: the tiny config falls back to plain rotary, with a review note.
    """
    rope = dict(rope)
    for key, value in rope.items():
        if isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
            kind = rope.get("rope_type") or rope.get("type") or "rotary"
            review.append(f"{kind} rope scaling has per-frequency values ({key}: {len(value)} values) that "
                          "depend on the head size and could not be scaled; the tiny config uses plain rotary. "
                          "Restore a matching rope_parameters to test it.")
            theta = rope.get("rope_theta")
            return {"rope_type": "default", **({"rope_theta": theta} if theta is not None else {})}
    if is_int(rope.get("original_max_position_embeddings")):
        rope["original_max_position_embeddings"] = scale.profile.positions // 4
        if isinstance(rope.get("factor"), (int, float)) and rope["factor"] > 4:
            rope["factor"] = 4.0  # max_position / original_max == factor, as the real model has it
    return rope
