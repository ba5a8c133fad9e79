"""A layer stack configured by a nested sub-config (``block.config_section``).

Some models are built of several stacks of layers, each sized by a sub-config of its own
(a byte-level model's local encoder, global transformer and local decoder), and their
config counts no layers at its top level. A family serves one of those stacks: the one
whose sub-config ``block.config_section`` names. The family's config then reads every
attribute its top level lacks (``num_hidden_layers``, ``hidden_size``, the head counts...)
from that sub-config, so blocks, KV sizing, the wire and the client see the served
stack's sizes; what the top level has keeps its own value.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SECTION_ATTRIBUTE", "section_namespace", "sectioned_config_class", "section_of"]

#: The class attribute naming the sub-config field a config class reads its missing attributes from.
SECTION_ATTRIBUTE = "layer_config_section"


def section_namespace(section: str) -> dict[str, Any]:
    """Class members making a config read the attributes it lacks from its sub-config ``section``."""

    def __getattr__(self: Any, name: str) -> Any:
        sub = self.__dict__.get(section) if not name.startswith("__") and name != section else None
        if sub is None or isinstance(sub, dict):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(sub, name)

    return {"__getattr__": __getattr__, SECTION_ATTRIBUTE: section}


def sectioned_config_class(config_class: type, section: str) -> type:
    """A subclass of ``config_class`` reading the attributes it lacks from its sub-config ``section``."""
    return type(config_class.__name__, (config_class,), {"__module__": config_class.__module__,
                                                          "__qualname__": config_class.__qualname__,
                                                          **section_namespace(section)})


def section_of(config: Any) -> Any:
    """The sub-config configuring ``config``'s served layer stack (None when its top level counts the layers)."""
    section = getattr(type(config), SECTION_ATTRIBUTE, None)
    return config.__dict__.get(section) if section else None
