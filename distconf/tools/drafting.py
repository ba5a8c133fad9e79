"""Draft a family file from a model's ``config.json`` (the engine of ``distconf new``).

``draft_family(family, config_dict)`` looks at the installed transformers to find what
a family file needs, without any per-family knowledge:

- the HF config class, from ``model_type`` through transformers' ``CONFIG_MAPPING``;
- the decoder-layer class and the state-dict prefix of the layers, from the causal-LM
  model built on the meta device (the ``ModuleList`` holding ``num_hidden_layers``
  layers);
- the attention class (the shallowest ``*Attention`` module inside a layer), the rotary
  module of the base model, and the keyword names of the layer's constructor and
  ``forward`` (``cache`` / ``layer_past`` ...), from signatures;
- the mask rule (layer types, sliding window on every layer, or plain causal), from
  the config and the base model's ``forward``;
- the KV-groups formula from the fields present, and the KV-cache geometry, checked
  against what a tiny model really caches;
- a ``tiny_config`` made by shrinking the given config, verified by building the tiny
  model and running it.

The result (`FamilyDraft`) renders as YAML with comments saying what was found and
what to review. Torch and transformers are imported inside the functions only.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DraftingError", "FamilyDraft", "draft_family", "read_config_json", "shrink_config",
    "FAMILY_NAME_PATTERN",
]

logger = logging.getLogger(__name__)

FAMILY_NAME_PATTERN = r"^[a-z][a-z0-9_]*$"

# Fields of a config.json that describe a checkpoint or a runtime, not an architecture.
_DROP_KEYS = {
    "architectures", "auto_map", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
    "model_type", "quantization_config", "use_cache", "initializer_range", "task_specific_params",
    "id2label", "label2id", "tokenizer_class", "attn_implementation", "_attn_implementation",
    "output_router_logits", "router_aux_loss_coef", "aux_loss_alpha", "seq_aux",
    "cache_implementation", "return_dict", "torchscript", "pretraining_tp", "max_length",
}
_DROP_PATTERNS = ("dropout", "pdrop")

_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
_HEADS_KEYS = ("num_attention_heads", "n_head")
_KV_HEADS_KEYS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
_LAYERS_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_INTERMEDIATE_KEYS = ("intermediate_size", "n_inner", "ffn_hidden_size")
_VOCAB_KEYS = ("vocab_size",)
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "seq_length")
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_TOKEN_ID_DEFAULTS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

TINY_HIDDEN = 64
TINY_HEADS = 4
TINY_VOCAB = 256
TINY_INTERMEDIATE = 128
TINY_WINDOW = 4
TINY_POSITIONS = 128
TINY_TEST_TOKENS = 12

_CACHE_ARGUMENTS = ("cache", "past_key_values", "layer_past", "past_key_value")
_LAYER_IDX_ARGUMENTS = ("layer_idx", "layer_id", "layer_number", "layer_index")


class DraftingError(ValueError):
    """The config cannot be drafted into a family file (the message says why)."""


@dataclass
class FamilyDraft:
    """A first draft of a family file; `to_yaml` renders it with review comments."""

    family: str
    model_type: str
    config_class: str
    layer_class: str
    attention_class: str | None
    prefix: str
    base_model_prefix: str | None = None
    attn_implementation: str = "sdpa"
    constructor: dict[str, Any] = field(default_factory=dict)
    call: dict[str, Any] = field(default_factory=dict)
    position: dict[str, Any] = field(default_factory=dict)
    mask: dict[str, Any] = field(default_factory=dict)
    kv_groups: int | str = 1
    kv_cache: dict[str, Any] = field(default_factory=dict)
    tiny_config: dict[str, Any] = field(default_factory=dict)
    dht_prefix: dict[str, Any] = field(default_factory=lambda: {"name": "repo"})
    facts: list[str] = field(default_factory=list)
    review: list[str] = field(default_factory=list)

    def to_yaml(self, schema_path: str = "../schemas/family.schema.json") -> str:
        """The family file text: fields in the usual order, findings and TODOs as comments."""
        lines = [f"# yaml-language-server: $schema={schema_path}",
                 f"# Draft written by `distconf new {self.family}`: review every line, then run",
                 f"#   distconf check {self.family}.yaml"]
        for fact in self.facts:
            lines.extend(_comment_lines(fact))
        for item in self.review:
            lines.extend(_comment_lines("TODO review: " + item))
        lines.append(f"family: {self.family}")
        lines.append(f"model_type: {_scalar(self.model_type)}")
        lines.append(f"config_class: {self.config_class}")
        block: dict[str, Any] = {
            "layer_class": self.layer_class,
            "attention_class": self.attention_class or "transformers.TODO_AttentionClass",
            "prefix": self.prefix,
        }
        if self.base_model_prefix:
            block["base_model_prefix"] = self.base_model_prefix
        if self.attn_implementation != "sdpa":
            block["attn_implementation"] = self.attn_implementation
        for key in ("constructor", "call", "position", "mask"):
            value = getattr(self, key)
            if value:
                block[key] = value
        lines.append(_dump({"block": block}))
        lines.append(f"kv_groups: {_scalar(self.kv_groups)}")
        if self.kv_cache:
            lines.append(_dump({"kv_cache": self.kv_cache}))
        lines.append(_dump({"dht_prefix": self.dht_prefix}))
        if self.tiny_config:
            lines.append(_dump({"tiny_config": self.tiny_config}))
        return "\n".join(line.rstrip() for line in lines) + "\n"


def _comment_lines(text: str) -> list[str]:
    import textwrap

    return ["# " + line for line in textwrap.wrap(text, width=88, subsequent_indent="  ")]


def _scalar(value: Any) -> str:
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("...").strip()


def _dump(mapping: Mapping[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(dict(mapping), default_flow_style=False, sort_keys=False, width=100).rstrip()


def read_config_json(path: str | Path) -> dict[str, Any]:
    """Read a model's ``config.json`` (a file, or a folder holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DraftingError(f"{path}: no such file (give a config.json or a folder holding one)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DraftingError(f"{path}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise DraftingError(f"{path}: not valid JSON: {exc.msg} (line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise DraftingError(f"{path}: a config.json must be a JSON object")
    return data


# ----------------------------------------------------------------------------- paths


def _class_path(cls: type) -> str:
    """Dotted path of a class; the short ``transformers.Name`` when it is exported."""
    import transformers

    name = cls.__name__
    if getattr(transformers, name, None) is cls:
        return f"transformers.{name}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _module_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _first(mapping: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[str | None, Any]:
    for key in keys:
        if key in mapping and mapping[key] is not None:
            return key, mapping[key]
    return None, None


# ----------------------------------------------------------------------------- shrinking


def _layer_types_pattern(types: list[Any], count: int) -> list[Any]:
    distinct: list[Any] = []
    for item in types:
        if item not in distinct:
            distinct.append(item)
    return [distinct[i % len(distinct)] for i in range(count)]


def _shrink_rope(rope: Any, review: list[str]) -> Any:
    if not isinstance(rope, dict):
        return rope
    rope = dict(rope)
    if "short_factor" in rope or "long_factor" in rope:
        review.append("rope scaling with per-dimension factors (longrope) depends on the head size; the tiny "
                      "config uses plain rotary. Restore a matching rope_parameters to test it.")
        theta = rope.get("rope_theta")
        return {"rope_type": "default", **({"rope_theta": theta} if theta is not None else {})}
    if "original_max_position_embeddings" in rope:
        rope["original_max_position_embeddings"] = TINY_POSITIONS // 4
        if isinstance(rope.get("factor"), (int, float)) and rope["factor"] > 4:
            rope["factor"] = 4.0  # keeps max_position / original_max == factor, as the real model has it
    if "mrope_section" in rope:
        review.append("rope mrope_section depends on the head size; adjust it in tiny_config.")
    return rope


def shrink_config(config: Mapping[str, Any], review: list[str] | None = None, *,
                  derived_layer_types: list[Any] | None = None) -> dict[str, Any]:
    """A tiny version of ``config`` (a ``config.json`` dict) keeping every architecture flag.

    Sizes shrink (hidden 64, 4 heads, vocab 256, intermediate 128, 2-3 layers, 4
    experts, window 4 ...), the proportions that matter are kept (GQA stays GQA, an
    explicit ``head_dim`` stays different from hidden/heads, key and value head sizes
    stay different), checkpoint and runtime fields are dropped. Things a reviewer
    should look at are appended to ``review``. ``derived_layer_types`` is the
    per-layer type list the config class computes when the file has none (it decides
    how many tiny layers are needed to have every type).
    """
    review = review if review is not None else []
    src = {k: v for k, v in config.items()
           if k not in _DROP_KEYS and not any(p in k for p in _DROP_PATTERNS)}
    out = copy.deepcopy(src)
    if "text_config" in out and not any(k in out for k in _LAYERS_KEYS):
        raise DraftingError("this config nests its language model under text_config; draft a family for the "
                            "text model (its own model_type) from the text_config section instead")

    _, heads = _first(src, _HEADS_KEYS)
    _, hidden = _first(src, _HIDDEN_KEYS)
    for key in _HIDDEN_KEYS:
        if key in out and out[key] is not None:
            out[key] = TINY_HIDDEN
    for key in _HEADS_KEYS:
        if key in out and out[key] is not None:
            out[key] = TINY_HEADS
    for key in _KV_HEADS_KEYS:
        value = src.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and isinstance(heads, int):
            out[key] = TINY_HEADS if value >= heads else (1 if value == 1 else 2)
    natural = TINY_HIDDEN // TINY_HEADS
    head_dim = src.get("head_dim")
    if isinstance(head_dim, int) and isinstance(hidden, int) and isinstance(heads, int):
        out["head_dim"] = natural if head_dim * heads == hidden else 2 * natural
    scalar = src.get("query_pre_attn_scalar")
    if isinstance(scalar, (int, float)) and isinstance(hidden, int) and isinstance(heads, int):
        if isinstance(head_dim, int) and scalar == head_dim:
            out["query_pre_attn_scalar"] = out["head_dim"]
        elif scalar * heads == hidden:
            out["query_pre_attn_scalar"] = natural

    # latent attention: keep key and value head sizes different, as in the real model
    for key, tiny in (("kv_lora_rank", 16), ("qk_nope_head_dim", 16), ("qk_rope_head_dim", 8),
                      ("v_head_dim", 12), ("q_lora_rank", 24)):
        if isinstance(src.get(key), int):
            out[key] = tiny

    for key in _INTERMEDIATE_KEYS:
        if isinstance(src.get(key), int):
            out[key] = TINY_INTERMEDIATE
    for key, tiny in (("moe_intermediate_size", 32), ("shared_expert_intermediate_size", 64)):
        if isinstance(src.get(key), int):
            out[key] = tiny
    is_moe = any(isinstance(src.get(k), int) and src[k] > 0 for k in _EXPERT_COUNT_KEYS)
    for key in _EXPERT_COUNT_KEYS:
        if isinstance(src.get(key), int) and src[key] > 0:
            out[key] = 4
    for key in ("num_experts_per_tok", "moe_topk"):
        if isinstance(src.get(key), int) and src[key] > 0:
            out[key] = 2
    if isinstance(src.get("n_shared_experts"), int) and src["n_shared_experts"] > 0:
        out["n_shared_experts"] = 1
    for key in ("n_group", "topk_group"):
        if isinstance(src.get(key), int):
            out[key] = 1

    # layers: 3 when layers differ (layer types, dense/MoE mix), else 2
    layer_types = src.get("layer_types")
    all_types = layer_types if isinstance(layer_types, list) else derived_layer_types
    varied = (isinstance(all_types, list) and len(set(map(str, all_types))) > 1) or (
        is_moe and (bool(src.get("first_k_dense_replace")) or bool(src.get("mlp_only_layers"))
                    or (src.get("decoder_sparse_step") or 1) > 1)) or bool(src.get("use_sliding_window"))
    layers = 3 if varied else 2
    for key in _LAYERS_KEYS:
        if isinstance(src.get(key), int):
            out[key] = layers
    if isinstance(layer_types, list) and layer_types:
        out["layer_types"] = _layer_types_pattern(layer_types, layers)
    if isinstance(src.get("first_k_dense_replace"), int) and src["first_k_dense_replace"] > 0:
        out["first_k_dense_replace"] = 1
    if src.get("mlp_only_layers"):
        out["mlp_only_layers"] = [0]
    if isinstance(src.get("decoder_sparse_step"), int) and src["decoder_sparse_step"] > 1:
        out["decoder_sparse_step"] = 2
    if src.get("use_sliding_window") and isinstance(src.get("max_window_layers"), int):
        out["max_window_layers"] = 1

    for key in _VOCAB_KEYS:
        if isinstance(src.get(key), int):
            out[key] = TINY_VOCAB
    for key in _POSITION_KEYS:
        if isinstance(src.get(key), int):
            out[key] = TINY_POSITIONS
    if isinstance(src.get("original_max_position_embeddings"), int):
        out["original_max_position_embeddings"] = TINY_POSITIONS
    for key in ("sliding_window", "sliding_window_size", "attention_chunk_size"):
        value = src.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[key] = TINY_WINDOW
    for key in ("rope_scaling", "rope_parameters"):
        if key in out:
            out[key] = _shrink_rope(out[key], review)

    for key, tiny in _TOKEN_ID_DEFAULTS.items():
        value = src.get(key)
        if isinstance(value, int) and value >= TINY_VOCAB:
            out[key] = tiny
        elif isinstance(value, list):
            kept = [v for v in value if isinstance(v, int) and v < TINY_VOCAB]
            out[key] = kept or [tiny]
    for key in ("decoder_start_token_id", "sep_token_id", "cls_token_id", "unk_token_id"):
        if isinstance(src.get(key), int) and src[key] >= TINY_VOCAB:
            out.pop(key)
    if "quantization_config" in config:
        review.append("the checkpoint is quantized (quantization_config); the tiny model is not.")
    return out


# ----------------------------------------------------------------------------- model inspection


def _find_layer_list(model: Any, num_layers: int | None) -> tuple[str, Any]:
    import torch

    candidates = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) == 0:
            continue
        if num_layers is not None and len(module) != num_layers:
            continue
        if not all(any(True for _ in child.parameters()) for child in module):
            continue
        params = sum(p.numel() for p in module.parameters())
        candidates.append((params, -name.count("."), name, module))
    if not candidates:
        raise DraftingError(
            f"no ModuleList of {num_layers} layers in {type(model).__name__}; is num_hidden_layers right?")
    candidates.sort(key=lambda c: (c[0], c[1]), reverse=True)
    _, _, name, module = candidates[0]
    return name, module


def _find_attention(layer: Any) -> tuple[type | None, str | None]:
    found = []
    for name, module in layer.named_modules():
        if not name:
            continue
        cls_name = type(module).__name__
        if "Attention" in cls_name and "Norm" not in cls_name:
            found.append((name.count("."), name, type(module)))
    if not found:
        return None, None
    found.sort(key=lambda f: f[0])
    return found[0][2], found[0][1]


def _find_rotary(model: Any, layers_prefix: str) -> tuple[type | None, list[str]]:
    outside, inside = [], []
    for name, module in model.named_modules():
        if "Rotary" in type(module).__name__:
            (inside if name.startswith(layers_prefix + ".") else outside).append((name, type(module)))
    notes = []
    if inside and not outside:
        notes.append(f"the layers own their rotary module ({inside[0][0]}); no rotary_class is needed")
    if outside:
        return outside[0][1], notes
    return None, notes


def _forward_parameters(cls: type) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return {}


def _mask_rule(config: Any, raw: Mapping[str, Any], base_model: Any, review: list[str]) -> dict[str, Any]:
    try:
        source = inspect.getsource(type(base_model).forward)
    except (OSError, TypeError):
        source = ""
    layer_types = getattr(config, "layer_types", None)
    has_window = hasattr(config, "sliding_window")
    if isinstance(layer_types, (list, tuple)) and layer_types and ("layer_types" in source or not source):
        rule: dict[str, Any] = {"layer_types_field": "layer_types"}
        kinds = {str(t) for t in layer_types}
        known = {"full_attention", "sliding_attention"}
        if kinds - known:
            review.append(f"layer_types has {sorted(kinds - known)}; map each type in block.mask.layer_kinds "
                          "(causal or sliding_window) or the family cannot be served generically")
        if has_window:
            rule["sliding_window"] = "sliding_window"
        elif "sliding_attention" in kinds:
            review.append("layer_types has sliding layers but the config has no sliding_window field; "
                          "set block.mask.sliding_window to the field holding the window")
        return rule
    if has_window and "create_sliding_window_causal_mask" in source:
        return {"kind": "sliding_window", "sliding_window": "sliding_window"}
    if has_window and not source:
        review.append("the config has sliding_window; check whether every layer slides (mask.kind)")
    return {}


def _kv_groups(config: Any, raw: Mapping[str, Any]) -> tuple[int | str, list[str]]:
    notes = []
    heads = getattr(config, "num_attention_heads", None)
    for key in _KV_HEADS_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return f"num_attention_heads // {key}", notes
    if getattr(config, "multi_query", False):
        notes.append("multi_query is set: each query head shares one KV head; check kv_groups")
        return "num_attention_heads", notes
    if heads is None:
        notes.append("no num_attention_heads field: set kv_groups by hand")
    return 1, notes


def _measured_cache(result: Any) -> tuple[int, int, int, int] | None:
    cache = getattr(result, "cache", None) or getattr(result, "past_key_values", None)
    if cache is None:
        return None
    layers = getattr(cache, "layers", None)
    try:
        if layers:
            key, value = layers[-1].keys, layers[-1].values
        else:
            key, value = cache[-1][0], cache[-1][1]
    except (AttributeError, IndexError, TypeError, KeyError):
        return None
    if key is None or value is None or key.dim() != 4 or value.dim() != 4:
        return None
    return int(key.shape[1]), int(key.shape[-1]), int(value.shape[1]), int(value.shape[-1])


def _field_for(config: Any, value: int, *, heads: bool = False) -> int | str:
    """A formula over config fields giving ``value`` on the tiny config, else ``value`` itself."""
    attention_heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if heads:
        if value == 1:
            return 1
        if value == attention_heads:
            return "num_attention_heads"
    else:
        if getattr(config, "head_dim", None) == value:
            return "head_dim"
        if hidden and attention_heads and hidden // attention_heads == value:
            return "hidden_size // num_attention_heads"
    for name, field_value in sorted(vars(config).items()):
        if field_value == value and isinstance(field_value, int) and not isinstance(field_value, bool) \
                and not name.startswith("_"):
            return name
    return value


def _kv_cache_section(config: Any, groups: int | str, measured: tuple[int, int, int, int] | None,
                      review: list[str], facts: list[str]) -> dict[str, Any]:
    from distconf.family.formula import Formula, FormulaError

    if measured is None:
        review.append("could not read the tiny model's cache; check kv_cache by hand")
        return {}
    k_heads, k_dim, v_heads, v_dim = measured
    facts.append(f"tiny model caches keys [*, {k_heads}, tokens, {k_dim}] and values [*, {v_heads}, tokens, "
                 f"{v_dim}] per layer")
    try:
        group_count = groups if isinstance(groups, int) else int(Formula(groups).evaluate_on(config))
        heads = config.num_attention_heads // group_count
    except (FormulaError, AttributeError, TypeError, ZeroDivisionError):
        heads = None
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
        if getattr(config, "hidden_size", None) and getattr(config, "num_attention_heads", None) else None)
    if (k_heads, v_heads) == (heads, heads) and k_dim == v_dim == head_dim:
        return {}
    if (getattr(config, "kv_lora_rank", None), getattr(config, "qk_rope_head_dim", None)) == (k_dim, v_dim) \
            and k_heads == v_heads == 1:
        facts.append("latent attention: the cache keeps the compressed kv_lora_rank latent and the "
                     "qk_rope_head_dim rotated key, one head per token")
        return {"num_kv_heads": 1, "key_head_dim": "kv_lora_rank", "value_head_dim": "qk_rope_head_dim"}
    if heads and k_heads == v_heads == getattr(config, "num_attention_heads", None) and k_heads != heads \
            and k_dim == v_dim == head_dim:
        facts.append("the attention writes every KV head repeated per query head; the block stores one copy")
        return {"layer_writes": "repeat_interleave"}
    section: dict[str, Any] = {"num_kv_heads": _field_for(config, k_heads, heads=True),
                               "key_head_dim": _field_for(config, k_dim),
                               "value_head_dim": _field_for(config, v_dim)}
    review.append("the cache geometry is not the default num_kv_heads x (head_dim + head_dim); kv_cache was "
                  "filled from the tiny model's cache and the config fields with those values: check that "
                  "these formulas hold for the real sizes")
    return section


def _run_tiny(config_cls: type, tiny: dict[str, Any], attn_implementation: str) -> tuple[Any, str | None]:
    """Build the tiny model and run 12 tokens through it with a cache."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        config = config_cls(**tiny)
        config._attn_implementation = attn_implementation
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        ids = torch.randint(0, TINY_VOCAB, (1, TINY_TEST_TOKENS))
        with torch.no_grad():
            result = model(ids, use_cache=True)
    except Exception as exc:  # any failure is reported to the user, never hidden
        return None, f"{type(exc).__name__}: {exc}"
    return result, None


def _non_default(tiny: dict[str, Any], config_cls: type) -> dict[str, Any]:
    """Drop the null / false entries that equal the config class's defaults (noise).

    Numbers and strings are kept even when they equal a default: they document the
    real model (softcapping values, rope theta, activation) and survive a change of
    defaults in transformers.
    """
    try:
        defaults = config_cls().to_dict()
    except Exception:  # some classes need arguments; then keep everything
        return dict(sorted(tiny.items()))
    kept = {}
    for key, value in tiny.items():
        if value is None and defaults.get(key) is None:
            continue
        if key in defaults and defaults[key] == value and value is False:
            continue
        kept[key] = value
    return dict(sorted(kept.items()))


def draft_family(family: str, config: Mapping[str, Any], *, run_tiny: bool = True) -> FamilyDraft:
    """Draft the family file of a model from its ``config.json`` contents.

    Raises `DraftingError` when the config cannot be used (no or unknown
    ``model_type``, no causal-LM class, no layer list). Everything else that needs a
    human is listed in the draft's ``review`` notes.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not re.match(FAMILY_NAME_PATTERN, family) or len(family) > 64:
        raise DraftingError(f"family name {family!r} must be lower case letters, digits and '_', "
                            "starting with a letter")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise DraftingError("the config has no model_type; it is the field that picks the Hugging Face classes")
    if model_type not in CONFIG_MAPPING:
        raise DraftingError(
            f"model_type {model_type!r} is not known to the installed transformers; upgrade transformers, or "
            "write the family by hand with classes from a trusted package (DISTCONF_TRUSTED_MODULES)")
    config_cls = CONFIG_MAPPING[model_type]
    config = copy.deepcopy(dict(config))  # transformers edits nested rope dicts in place
    if "text_config" in config and not any(k in config for k in _LAYERS_KEYS):
        shrink_config(config)  # raises the explanation before any model is built
    review: list[str] = []
    facts: list[str] = []

    try:
        full = AutoConfig.for_model(**dict(config))
    except Exception as exc:  # report the transformers message as is
        raise DraftingError(f"{config_cls.__name__} rejects this config.json: {exc}") from None
    text = full.get_text_config() if hasattr(full, "get_text_config") else full
    num_layers = getattr(text, "num_hidden_layers", None)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(full)
    except ValueError as exc:
        raise DraftingError(f"no causal-LM model class for {config_cls.__name__} in transformers: "
                            f"{str(exc).splitlines()[0]}") from None
    prefix, layers = _find_layer_list(model, num_layers)
    layer_cls = type(layers[0])
    classes = {type(layer).__name__ for layer in layers}
    if len(classes) > 1:
        review.append(f"layers have different classes ({', '.join(sorted(classes))}); a family has one layer class")
    base_prefix = getattr(type(model), "base_model_prefix", None)
    base_prefix = base_prefix if base_prefix and prefix.startswith(base_prefix + ".") else None
    base_model = model.get_submodule(base_prefix) if base_prefix else model
    facts.append(f"{type(model).__name__} keeps its {len(layers)} layers ({layer_cls.__name__}) in '{prefix}'")

    attention_cls, attention_name = _find_attention(layers[0])
    if attention_cls is None:
        review.append(f"no *Attention module inside {layer_cls.__name__}; set attention_class by hand")
    else:
        facts.append(f"attention module '{attention_name}' is {attention_cls.__name__}")

    draft = FamilyDraft(
        family=family, model_type=model_type, config_class=_class_path(config_cls),
        layer_class=_module_path(layer_cls),
        attention_class=_module_path(attention_cls) if attention_cls else None,
        prefix=prefix, base_model_prefix=base_prefix, facts=facts, review=review,
    )
    if getattr(type(model), "_supports_sdpa", True) is False:
        draft.attn_implementation = "eager"
        facts.append(f"{type(model).__name__} does not support sdpa: eager attention")

    # constructor
    try:
        init_params = [p for p in inspect.signature(layer_cls.__init__).parameters.values()
                       if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    except (TypeError, ValueError):
        init_params = []
    names = [p.name for p in init_params]
    if names and names[0] != "config":
        draft.constructor["config_argument"] = names[0]
    idx_name = next((n for n in _LAYER_IDX_ARGUMENTS if n in names), None)
    if idx_name is None:
        draft.constructor["layer_idx_argument"] = None
    elif idx_name != "layer_idx":
        draft.constructor["layer_idx_argument"] = idx_name
    required = [p.name for p in init_params[1:] if p.default is p.empty and p.name != idx_name]
    if required:
        review.append(f"{layer_cls.__name__}() also requires {', '.join(required)}: add them under "
                      "block.constructor.extra as formulas over config fields")

    # call
    params = _forward_parameters(layer_cls)
    cache_arg = next((n for n in _CACHE_ARGUMENTS if n in params), None)
    if cache_arg is None:
        review.append(f"{layer_cls.__name__}.forward takes no cache argument: incremental decoding needs one")
    elif cache_arg != "cache":
        draft.call["cache_argument"] = cache_arg
        facts.append(f"the layer takes its cache as '{cache_arg}' (a 'cache=' keyword would be ignored)")
    for key, name in (("mask_argument", "attention_mask"), ("position_ids_argument", "position_ids"),
                      ("position_embeddings_argument", "position_embeddings")):
        if name not in params:
            draft.call[key] = None
    # positions: rotary module of the base model, and / or an ALiBi tensor argument
    rotary_cls, rotary_notes = _find_rotary(model, prefix)
    facts.extend(rotary_notes)
    if rotary_cls is not None and "position_embeddings" in params:
        draft.position["rotary_class"] = _module_path(rotary_cls)
        if "layer_type" in _forward_parameters(rotary_cls):
            draft.position["rotary_layer_type_argument"] = True
    if "alibi" in params:
        draft.call["alibi_argument"] = "alibi"
        module = inspect.getmodule(layer_cls)
        builder = getattr(module, "build_alibi_tensor", None)
        if callable(builder):
            draft.position["alibi_function"] = f"{module.__name__}.build_alibi_tensor"
        else:
            review.append("the layer takes an alibi tensor: set block.position.alibi_function")
    if "rotary_class" in draft.position:
        if "alibi_function" in draft.position:
            alibi_flag = "alibi" if isinstance(getattr(full, "alibi", None), bool) else None
            draft.position["alibi_when"] = alibi_flag or "TODO_formula_true_when_alibi"
            if alibi_flag is None:
                review.append("the layer supports rotary and ALiBi: set block.position.alibi_when")
    elif rotary_cls is not None:
        review.append(f"{rotary_cls.__name__} exists but the layer takes no position_embeddings; check "
                      "block.position")

    # mask
    draft.mask = _mask_rule(text, config, base_model, review)
    window = getattr(text, "sliding_window", None)
    types = [str(t) for t in (getattr(text, "layer_types", None) or [])]
    if draft.mask.get("kind") == "sliding_window" and window:
        facts.append(f"every layer has sliding-window attention ({window} tokens: query q sees keys "
                     "q-window+1 .. q)")
    elif "layer_types_field" in draft.mask:
        counts = ", ".join(f"{types.count(t)} {t}" for t in dict.fromkeys(types))
        facts.append(f"mask per layer from layer_types ({counts}); sliding_window={window}")

    # kv groups
    draft.kv_groups, notes = _kv_groups(text, config)
    review.extend(notes)

    # tiny config, verified by a run; KV geometry from what it really caches
    derived = getattr(text, "layer_types", None)
    tiny = shrink_config(config, review, derived_layer_types=list(derived) if derived else None)
    draft.tiny_config = _non_default(tiny, config_cls)
    if run_tiny:
        result, error = _run_tiny(config_cls, tiny, draft.attn_implementation)
        if error is not None:
            review.append(f"the tiny config does not run: {error}; fix tiny_config")
        else:
            tiny_config = config_cls(**tiny)
            draft.kv_cache = _kv_cache_section(tiny_config, draft.kv_groups, _measured_cache(result), review, facts)
    del model
    return draft
