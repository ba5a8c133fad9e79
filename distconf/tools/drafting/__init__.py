"""Draft a family file from a model's ``config.json`` (the engine of ``distconf new``).

``draft_family(family, config_dict)`` looks at the installed transformers to find what
a family file needs, without any per-family knowledge:

- the HF config class, from ``model_type`` through transformers' ``CONFIG_MAPPING``,
  and the standard name of every field through the class's ``attribute_map``
  (`fields`);
- the decoder-layer class and the state-dict prefix of the layers, from the causal-LM
  model built on the meta device; the attention class, the rotary module and the
  keyword names of the layer's constructor and ``forward`` (`scan`, `sections`), and
  inputs the model prepares for its layers, read from its source (`layer_call`);
- the mask rule (layer types, sliding window on every layer, or plain causal);
- a ``tiny_config`` made by shrinking the given config consistently (`shrink`,
  `profile`, `layers`, `rope`), limited to the fields the class reads (`readable`),
  deep enough to have every kind of layer of the real model (`tiny`), with a variant
  per shipped preset of the model_type that has other kinds of layers (`variants`),
  verified by building the tiny models and running them (`probe`);
- the KV-groups formula and the KV-cache geometry, checked against what the tiny
  models really cache (`kv`, `kvmerge`).

The result (`FamilyDraft`, `render`) renders as YAML with comments saying what was
found and what to review. Torch and transformers are imported inside the functions only.
"""

from distconf.tools.drafting.common import FAMILY_NAME_PATTERN, DraftingError, read_config_json
from distconf.tools.drafting.draft import draft_family
from distconf.tools.drafting.render import FamilyDraft
from distconf.tools.drafting.shrink import shrink_config

__all__ = [
    "DraftingError", "FamilyDraft", "draft_family", "read_config_json", "shrink_config", "FAMILY_NAME_PATTERN",
]
