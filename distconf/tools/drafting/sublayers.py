"""Layer modules that each hold several attention sublayers (``block.modules_field``, ``kv_cache.sublayers``).

Some models count attention sublayers in ``num_hidden_layers`` and build half (a third...) as many
layer modules, each running its sublayers in turn with their own cache indices. A swarm serves one block
per module: the draft names the config field counting the modules, and the sublayers each module caches.
"""

from __future__ import annotations

from typing import Any

from distconf.tools.drafting.common import DraftingError
from distconf.tools.drafting.render import FamilyDraft
from distconf.tools.drafting.scan import ModelScan

__all__ = ["draft_modules_field", "finish_sublayers"]


def draft_modules_field(draft: FamilyDraft, scan: ModelScan, config: Any) -> None:
    """``block.modules_field``: the config field whose value is the number of layer modules, when each holds
    sublayers; a one-line refusal when no field holds that number."""
    if scan.sublayers == 1:
        return
    modules = len(scan.layers)
    values = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    fields = sorted((name for name, value in values.items() if name != "num_hidden_layers"
                     and isinstance(value, int) and not isinstance(value, bool) and value == modules),
                    key=lambda name: ("layer" not in name, name))
    if not fields:
        raise DraftingError(f"{type(scan.model).__name__} builds {modules} layer modules of {scan.sublayers} "
                            f"attention sublayers each, and no config field holds {modules}: a family needs the "
                            "field counting the modules (block.modules_field)")
    draft.modules_field = fields[0]
    draft.facts.append(f"each of the {modules} layer modules holds {scan.sublayers} attention sublayers "
                       f"(num_hidden_layers counts them): one block per module, counted by {fields[0]!r}")


def finish_sublayers(draft: FamilyDraft, sublayers: int) -> None:
    """``kv_cache.sublayers``: each block caches the K/V of its sublayers, side by side."""
    if sublayers > 1:
        draft.kv_cache = {**draft.kv_cache, "sublayers": sublayers}
