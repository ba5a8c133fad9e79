"""The most positions a session of a family's model may hold (``block.position.max_positions``)."""

from __future__ import annotations

from distconf.loader.config_protocol import DistributedConfig
from distconf.loader.formula import FormulaError

__all__ = ["max_positions"]


def max_positions(config: DistributedConfig | object) -> int | None:
    """Positions past which the blocks of ``config``'s family cannot compute (None: no such limit, or a plain
    transformers config); a formula that cannot be evaluated on this config is an error naming the family file's
    field."""
    if not isinstance(config, DistributedConfig):
        return None
    formula = type(config).family_spec.block.position.max_positions
    if formula is None:
        return None
    try:
        return int(formula.evaluate_on(config))
    except FormulaError as exc:
        raise type(config).family_source.error(("block", "position", "max_positions"), str(exc)) from None
