"""State sizes scaled by a float factor of the config (``int(hidden_size * qk_dim_factor) // num_heads``).

Some layers size their heads from a width times a float field of the config, truncated, then
divided by a count. The drafter's formula search (`distconf.tools.drafting.state`) tries these
forms when no product, sum or quotient of integer fields gives a state's dimension.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from distconf.tools.drafting.common import field_value

__all__ = ["float_fields", "factor_candidates", "evaluate_factor"]

_MAX_FACTOR = 64.0


def float_fields(config: Any, raw: Mapping[str, Any]) -> dict[str, float]:
    """Positive float fields of ``config`` that can scale a width (config.json's own first)."""
    found: dict[str, float] = {}
    for key in dict.fromkeys([*raw, *sorted(config.to_dict())]):
        value = field_value(config, key)
        if not key.startswith("_") and isinstance(value, float) and 0 < value <= _MAX_FACTOR:
            found[key] = value
    return found


def factor_candidates(ints: Mapping[str, int], floats: Mapping[str, float], value: int,
                      whole: bool = False) -> list[tuple[str, tuple[str, ...]]]:
    """Formulas ``int(a * f)`` and ``int(a * f) // b`` (``a``, ``b`` integer fields, ``f`` a float one) giving
    ``value``; ``whole``: with factors of a whole value only (1.0, which doubling the factor tells apart)."""
    found = []
    for a, width in ints.items():
        for f, factor in floats.items():
            if whole and not factor.is_integer():
                continue
            scaled = int(width * factor)
            if scaled == value:
                found.append((f"int({a} * {f})", (a, f)))
            found += [(f"int({a} * {f}) // {b}", (a, f, b)) for b, count in ints.items()
                      if b != a and 1 < count < scaled and scaled // count == value]
    return found


def evaluate_factor(term: str, fields: Mapping[str, float]) -> int:
    """A term ``int(a * f)`` or ``int(a * f) // b`` of `factor_candidates` evaluated on ``fields``."""
    inner, _, rest = term.removeprefix("int(").partition(")")
    a, f = inner.split(" * ")
    scaled = int(fields[a] * fields[f])
    divisor = rest.removeprefix(" // ").strip()
    return scaled // int(fields[divisor]) if divisor else scaled
