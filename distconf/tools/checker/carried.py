"""The bound of a carried-value stand-in (``block.call.carried_arguments``), proved on the tiny model.

The blocks' runs prove the stand-in within the bound (the tiny sequences are short). That the bound
is the right field is proved apart: with the field set to fewer keys than a run has, the model's own
carried value must cover exactly that many keys (so past the bound it differs from every key, and the
blocks are right to refuse).
"""

from __future__ import annotations

from typing import Any

from distconf.tools.checker.failures import located_failure

__all__ = ["check_carried_bounds"]

_NARROW = 3


def check_carried_bounds(cls: type, reference: Any, values: dict[str, Any]) -> None:
    """Each carried argument reaches the layers as the model's loop passes it, bounded by its ``exact_up_to``."""
    from distconf.loader.formula import Formula
    from distconf.tools.drafting.carried import carried_values
    from distconf.tools.drafting.streams import carried_keywords

    spec = cls.family_spec.block  # type: ignore[attr-defined]
    if not spec.call.carried_arguments:
        return
    owner, _, attribute = spec.prefix.rpartition(".")
    module = reference.model.get_submodule(owner) if owner else reference.model
    indices = dict(carried_keywords(module, attribute).values())
    for keyword, argument in spec.call.carried_arguments.items():
        loc = ("block", "call", "carried_arguments", keyword)
        if keyword not in indices:
            raise located_failure(cls, loc, f"{type(module).__name__} hands its layers no value from the layer "
                                  f"before as {keyword!r}")
        bound = argument.exact_up_to
        field = next(iter(bound.names)) if isinstance(bound, Formula) and str(bound) in bound.names else None
        if field is None:
            continue  # a constant or an expression: nothing single to narrow
        seen = carried_values(cls.hf_config_class, {**values, field: _NARROW},  # type: ignore[attr-defined]
                              spec.attn_implementation or "sdpa", indices[keyword])
        widths = {int(v.shape[-1]) for v in seen or [] if hasattr(v, "shape")}
        if widths != {_NARROW}:
            raise located_failure(cls, (*loc, "exact_up_to"), f"with {field}={_NARROW} the model's {keyword} covers "
                                  f"{', '.join(map(str, sorted(widths))) or 'no'} keys of each query, not "
                                  f"{_NARROW}: {field} does not bound it")
