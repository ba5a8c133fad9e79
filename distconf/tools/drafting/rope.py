"""Shrinking rotary-embedding parameters (``rope_scaling`` / ``rope_parameters``) with the head size."""

from __future__ import annotations

from typing import Any

from distconf.tools.drafting.common import is_int
from distconf.tools.drafting.profile import Scale

__all__ = ["shrink_rope"]


def shrink_rope(rope: Any, scale: Scale, review: list[str], rotary_fraction: float = 1.0) -> Any:
    """A rope mapping for the tiny model.

    Lists of one factor per rotary frequency (length rotary_dim / 2) are resampled to
    the tiny rotary size; per-frequency sections are scaled with the head size; the
    original context length shrinks with the tiny positions, keeping the scaling factor
    (at most 4). What cannot be scaled falls back to plain rotary, with a review note.
    """
    if not isinstance(rope, dict):
        return rope
    rope = dict(rope)
    real_half = _half_rotary(scale.anchors.head_size, rotary_fraction)
    tiny_half = _half_rotary(scale.head_dim, rotary_fraction)
    for key, value in list(rope.items()):
        if not (isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value)):
            continue
        if real_half and tiny_half and len(value) == real_half:
            step = real_half / tiny_half
            rope[key] = [value[int(i * step)] for i in range(tiny_half)]
        elif all(is_int(v) for v in value) and (scaled := _scaled_sections(value, scale)) is not None:
            rope[key] = scaled
        else:
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


def _half_rotary(head_dim: int | None, fraction: float) -> int | None:
    if not head_dim:
        return None
    rotary = int(head_dim * fraction)
    return rotary // 2 if rotary >= 2 else None


def _scaled_sections(values: list[int], scale: Scale) -> list[int] | None:
    """Sections summing to a part of the head (e.g. per-axis rotary sections), scaled exactly."""
    real = scale.anchors.head_size
    if not real or sum(values) > real:
        return None
    scaled = [v * scale.head_dim // real for v in values]
    if any(v * scale.head_dim % real for v in values) or not all(scaled):
        return None
    return scaled
