"""The one place below the client that reaches into transformers internals (not its public API).

Masks, checkpoint conversion rules and a few private attributes of configs, models and parameters are not part of
transformers' stable API; every use in distconf goes through this module (and, for generation,
`distconf.client.hf_generation`), so a transformers upgrade touches those files only. Both are written for
`SUPPORTED_TRANSFORMERS`, pyproject's range: `check_transformers_version` says what to install otherwise.
Everything is imported lazily: importing this module imports no transformers code.
"""

from __future__ import annotations

from typing import Any

from distconf.versions import declared_range, version_in_range

SUPPORTED_TRANSFORMERS = declared_range("transformers")
"""The transformers versions distconf was written for: pyproject's requirement (its one home), capped at the newest
minor tested."""
TESTED_TRANSFORMERS = "5.24 and 5.25"
"""The transformers versions the tests ran on."""


class UnsupportedTransformersError(ImportError):
    """The installed transformers is outside `SUPPORTED_TRANSFORMERS`."""


def check_transformers_version(version: str | None = None) -> str:
    """Raise `UnsupportedTransformersError` unless ``version`` (default: the installed one) is supported.

    Returns the version checked.
    """
    if version is None:
        import transformers

        version = transformers.__version__
    if not version_in_range(version, SUPPORTED_TRANSFORMERS):
        raise UnsupportedTransformersError(
            f"distconf needs transformers {SUPPORTED_TRANSFORMERS} (tested with {TESTED_TRANSFORMERS}); "
            f"transformers {version} is installed: pip install 'transformers{SUPPORTED_TRANSFORMERS}'")
    return version


HF_INITIALIZED = "_is_hf_initialized"
"""The flag transformers sets on a tensor it initialized or loaded (skipped when it initializes a model again)."""


def attn_implementation(config: Any) -> str | None:
    """The attention implementation a config selects (transformers' private ``_attn_implementation``)."""
    return getattr(config, "_attn_implementation", None)


def set_attn_implementation(config: Any, implementation: str) -> None:
    """Select ``implementation`` (``eager``, ``sdpa``, ...) for the layers built from ``config``."""
    config._attn_implementation = implementation


def prepare_standalone_config(config: Any, attn_default: str) -> None:
    """What a model's ``from_config`` would set on ``config`` and a layer built alone does not get: the attention
    implementation (``attn_default`` when none is chosen) and eager experts dispatch."""
    if attn_implementation(config) is None:
        set_attn_implementation(config, attn_default)
    if getattr(config, "_experts_implementation", "unset") is None:
        config._experts_implementation = "eager"


def supports_sdpa(model_class: type) -> bool:
    """Whether a model class declares scaled-dot-product attention support (unknown: True)."""
    return getattr(model_class, "_supports_sdpa", True) is not False


def mark_initialized(tensor: Any) -> None:
    """Tell transformers ``tensor`` holds loaded values (it must not initialize it again)."""
    setattr(tensor, HF_INITIALIZED, True)


__all__ = [
    "HF_INITIALIZED", "SUPPORTED_TRANSFORMERS", "TESTED_TRANSFORMERS", "UnsupportedTransformersError",
    "attn_implementation", "check_transformers_version", "mark_initialized", "prepare_standalone_config",
    "set_attn_implementation", "supports_sdpa",
    "build_attention_mask", "causal_lm_class", "causal_lm_from_config",
    "chunked_mask_function", "initialize_computed_buffers", "non_persistent_buffers",
    "checkpoint_conversions", "converter_sources", "converter_targets", "rename_checkpoint_key",
    "run_conversion", "stacking_dims", "stacking_operations",
]


def chunked_mask_function(chunk_size: int, batch_size: int, device: Any, left_padding: Any = None) -> Any:
    """transformers' chunked causal mask function: causal within blocks of ``chunk_size`` tokens.

    ``left_padding``: ``[batch]`` padding positions before each row's first token (default none).
    """
    import torch
    from transformers.masking_utils import chunked_causal_mask_function

    if left_padding is None:
        left_padding = torch.zeros(batch_size, device=device, dtype=torch.long)
    return chunked_causal_mask_function(chunk_size, left_padding)


def build_attention_mask(implementation: str, *, batch_size: int, q_length: int, past: int,
                         window: int | None, allow_skip: bool, dtype: Any, config: Any, device: Any,
                         chunk: int | None = None, padding_mask: Any = None) -> Any:
    """The 4D mask a transformers model would give a layer (None when the implementation needs none).

    Causal, causal limited to ``window`` tokens back, or causal within blocks of ``chunk``
    tokens; built by transformers' own mask functions for ``implementation`` (``sdpa``,
    ``eager``, ...). ``padding_mask``: ``[batch, past + q_length]``, True where a key is a
    real token (rows of a batch padded on the left, as transformers pads for generation).
    """
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        causal_mask_function,
        sliding_window_causal_mask_function,
    )

    if implementation not in ALL_MASK_ATTENTION_FUNCTIONS:
        return None  # implementations that need no mask (e.g. paged kernels)
    left_padding = None
    if padding_mask is not None:
        left_padding = padding_mask.long().argmax(dim=-1)  # the first real key of each row
    if chunk is not None:
        mask_function, local_size = chunked_mask_function(chunk, batch_size, device, left_padding), chunk
    elif window is not None:
        mask_function, local_size = sliding_window_causal_mask_function(window), window
    else:
        mask_function, local_size = causal_mask_function, None
    return ALL_MASK_ATTENTION_FUNCTIONS[implementation](
        batch_size=batch_size, q_length=q_length, kv_length=past + q_length, q_offset=past, kv_offset=0,
        mask_function=mask_function, attention_mask=padding_mask, allow_is_causal_skip=allow_skip,
        local_size=local_size, dtype=dtype, config=config, use_vmap=False, device=device,
    )


def checkpoint_conversions(model_type: str) -> tuple[list[Any], list[Any]]:
    """transformers' checkpoint conversion rules of ``model_type``: (renamings, converters). transformers registers
    some under the name of the type's causal-LM or base model class rather than the type (class names first)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    keys = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type), MODEL_MAPPING_NAMES.get(model_type), model_type]
    mapping = next((found for key in keys if isinstance(key, str)
                    and (found := get_checkpoint_conversion_mapping(key))), None) or []
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    return renamings, converters


def rename_checkpoint_key(name: str, renamings: list[Any], converters: list[Any]) -> tuple[str, str | None]:
    """The parameter name a checkpoint tensor maps to, and the converter source pattern it matched (or None)."""
    from transformers.core_model_loading import rename_source_key

    return rename_source_key(name, renamings, converters)


def stacking_operations() -> tuple[type, type]:
    """transformers' ``(MergeModulelist, Concatenate)`` conversion operations (MoE expert fusion)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    return MergeModulelist, Concatenate


def converter_sources(converter: Any) -> list[str]:
    """The source name patterns of a checkpoint converter, in the order its operations use them."""
    return list(converter.source_patterns)


def converter_targets(converter: Any) -> list[str]:
    """The target name patterns of a checkpoint converter (several when it splits one fused tensor)."""
    return list(converter.target_patterns)


def stacking_dims(converter: Any) -> tuple[int, int | None] | None:
    """``(stack dim, concatenate dim or None)`` when ``converter`` only stacks per-expert tensors
    (``MergeModulelist``), optionally then concatenates the stacks (``Concatenate``); else None."""
    MergeModulelist, Concatenate = stacking_operations()
    ops = converter.operations
    if not ops or type(ops[0]) is not MergeModulelist or len(ops) > 2:
        return None
    if len(ops) == 2 and type(ops[1]) is not Concatenate:
        return None
    return ops[0].dim, (ops[1].dim if len(ops) == 2 else None)


def run_conversion(converter: Any, collected: dict[str, list[Any]], layer_name: str, config: Any,
                   model: Any = None) -> dict[str, Any]:
    """Run ``converter``'s operations on ``collected`` (source pattern -> tensors) as transformers does.

    ``model``: what operations that size their outputs by the model's parameters (``Split``)
    ask with ``get_parameter(name)``.
    """
    sources, targets = converter.source_patterns, converter.target_patterns
    for op in converter.operations:
        collected = op.convert(collected, source_patterns=sources, target_patterns=targets,
                               full_layer_name=layer_name, model=model, config=config, missing_keys=None)
    return collected


def non_persistent_buffers(module: Any) -> list[tuple[str, Any]]:
    """``(name, tensor)`` of every non-persistent buffer of ``module`` (as transformers lists them)."""
    found = []
    for name, tensor in module.named_buffers():
        owner_name, _, buffer_name = name.rpartition(".")
        if buffer_name in module.get_submodule(owner_name)._non_persistent_buffers_set:
            found.append((name, tensor))
    return found


def causal_lm_class(hf_config_class: type) -> type | None:
    """The transformers causal-LM class of a config class (None when there is none).

    ``AutoModelForCausalLM``'s mapping, else, for a config class it does not map (the text
    config nested under ``text_config`` of a multimodal config, whose model type the mapping
    lacks), the causal-LM class of the mapping declared with that ``config_class`` in the
    config's own modeling module. Every build of a family's causal LM goes through here.
    """
    import importlib

    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for klass in hf_config_class.__mro__:
        if klass in MODEL_FOR_CAUSAL_LM_MAPPING:
            return MODEL_FOR_CAUSAL_LM_MAPPING[klass]
        module_name = klass.__module__
        if ".configuration_" not in module_name:
            continue
        try:
            module = importlib.import_module(module_name.replace(".configuration_", ".modeling_"))
        except ImportError:
            continue
        for name in sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())):
            model_class = getattr(module, name, None)
            if isinstance(model_class, type) and getattr(model_class, "config_class", None) is klass:
                return model_class
    return None


def causal_lm_from_config(config: Any, **kwargs: Any) -> Any:
    """``AutoModelForCausalLM.from_config(config, **kwargs)``, for config classes it does not map too
    (`causal_lm_class`)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoModelForCausalLM

    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return AutoModelForCausalLM.from_config(config, **kwargs)
    model_class = causal_lm_class(type(config))
    if model_class is None:
        raise ValueError(f"no causal-LM model class for {type(config).__name__} in transformers "
                         "(AutoModelForCausalLM does not map it)")
    return model_class._from_config(config, **kwargs)


def _pretrained_model_class(hf_config_class: type) -> type | None:
    """The transformers ``PreTrainedModel`` class of a config class (through the auto model mapping)."""
    from transformers import MODEL_MAPPING

    try:
        return MODEL_MAPPING[hf_config_class]
    except (KeyError, ValueError):
        return causal_lm_class(hf_config_class)


def initialize_computed_buffers(module: Any, owners: list[Any], hf_config_class: type, config: Any) -> bool:
    """Run the model class's own ``_init_weights`` on ``owners`` (submodules of ``module``), as transformers
    does for non-persistent buffers after building a model on the meta device.

    Every parameter and buffer except those of ``owners``' fresh buffers is marked initialized
    first, so transformers' init functions leave loaded weights alone. Returns False when no
    model class is registered for ``hf_config_class``.
    """
    import torch

    model_class = _pretrained_model_class(hf_config_class)
    if model_class is None:
        return False
    fresh = {id(t) for owner in owners for t in owner.buffers(recurse=False)}
    for tensor in (*module.parameters(), *module.buffers()):
        if id(tensor) not in fresh:
            tensor._is_hf_initialized = True
    holder = model_class.__new__(model_class)
    torch.nn.Module.__init__(holder)
    holder.config = config
    with torch.no_grad():
        for owner in owners:
            model_class._init_weights(holder, owner)
    return True


def _tie_map(model: Any) -> dict[str, str]:
    """``{tied tensor: the tensor it is tied to}`` of a transformers model, full names (none without a map)."""
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    if not callable(expand):
        return {}
    try:
        return dict(expand(all_submodels=True))
    except TypeError:
        return dict(expand())


def tied_layer_tensors(model: Any, prefix: str) -> dict[int, dict[str, tuple[int, str]]]:
    """The tensors of the layers under ``prefix`` the model ties to another layer's: ``{layer: {local name: (that
    layer, local name there)}}``, from the model's own tie map (transformers saves only the latter)."""
    found: dict[int, dict[str, tuple[int, str]]] = {}
    for target, source in _tie_map(model).items():
        if not target.startswith(prefix + ".") or not source.startswith(prefix + "."):
            continue
        index, _, local = target[len(prefix) + 1:].partition(".")
        there, _, local_there = source[len(prefix) + 1:].partition(".")
        if index.isdigit() and there.isdigit() and index != there:
            found.setdefault(int(index), {})[local] = (int(there), local_there)
    return found


def untie_layer_list(model: Any, prefix: str) -> None:
    """Drop from the tie maps of ``model`` and its submodules every entry naming a tensor under ``prefix`` (the
    decoder-layer list the client replaces), so transformers ties no tensors of layers that are not there."""
    for name, module in model.named_modules():
        if name and not prefix.startswith(name + "."):
            continue
        below = f"{prefix[len(name) + 1:] if name else prefix}."
        for attribute in ("_tied_weights_keys", "all_tied_weights_keys"):
            ties = module.__dict__.get(attribute)  # the instance's own map; a class's names no layer
            if isinstance(ties, dict):
                module.__dict__[attribute] = {k: v for k, v in ties.items()
                                              if not k.startswith(below) and not v.startswith(below)}


def record_as_decoder_layer(module: Any) -> bool:
    """Have transformers' output capturing record ``module``'s input and output as a decoder layer's.

    Models that collect ``hidden_states`` with hooks on their decoder-layer class (rather
    than in their layer loop) would otherwise return none for a module standing in for
    the whole layer list. Returns False if this transformers has no output capturing.
    """
    try:
        from transformers.utils.output_capturing import install_output_capuring_hook
    except ImportError:  # pragma: no cover - older transformers collect hidden states in the loop
        return False
    install_output_capuring_hook(module, "hidden_states", 0, True)
    return True
