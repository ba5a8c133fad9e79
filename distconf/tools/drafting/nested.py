"""A language model nested under ``text_config`` (`text_section`): drafted from that section.

Some model types map to a causal-LM class whose ``config_class`` is not the mapped
config but the text config nested in it (a multimodal config whose language model can
run alone). The family is then drafted from the ``text_config`` section, with the text
config class (and its own model type); `distconf.blocks.hf_compat.causal_lm_class` finds
the causal-LM class of that config class where ``AutoModelForCausalLM`` does not map it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from distconf.blocks.hf_compat import causal_lm_class

__all__ = ["text_section"]


def text_section(config: Mapping[str, Any], config_class: type) -> tuple[dict[str, Any], type, str] | None:
    """(the ``text_config`` section with its model type, its config class, a fact) when the causal LM of
    ``config_class`` is configured by that section alone; None otherwise."""
    section = config.get("text_config")
    model_class = causal_lm_class(config_class) if isinstance(section, Mapping) else None
    text_class = getattr(model_class, "config_class", None)
    model_type = getattr(text_class, "model_type", None)
    if not isinstance(text_class, type) or text_class is config_class or not model_type:
        return None
    if section.get("model_type", model_type) != model_type:
        return None
    fact = (f"{model_class.__name__} is configured by {text_class.__name__} (model_type {model_type!r}), the "
            f"text_config section of {config_class.__name__}: the family is drafted from that section")
    return {**section, "model_type": model_type}, text_class, fact
