"""Shrinking a ``config.json`` to a tiny model of the same architecture (`shrink_config`).

Every field is read by its standard name (`FieldNames`) and shrinks by what it
measures (`role_of`): the anchor sizes go to the tiny profile (hidden 64, 4 heads,
vocab 256 ...), KV heads keep the attention kind (MHA, GQA, MQA), fields sized like a
head scale with the head size, widths scale with the hidden size, counts and indices of
layers and per-layer lists are cut to the same tiny layers (`plan_layers`), windows
shrink below the tokens a check runs, and a count of heads other than the attention's
keeps its product with the size of one head a width (``mamba_n_heads * mamba_d_head`` is
``expand * hidden``; `head_pairs`). Checkpoint and runtime fields are dropped.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from distconf.tools.drafting.common import DraftingError, is_int
from distconf.tools.drafting.fields import SIZE_WORDS, Anchors, FieldNames, config_class_for, has_experts, role_of
from distconf.tools.drafting.layers import LayerPlan, plan_layers
from distconf.tools.drafting.profile import TINY, Scale, TinyProfile
from distconf.tools.drafting.rope import shrink_rope

__all__ = ["shrink_config", "shrink_with_plan", "head_pairs", "CHECKPOINT_KEYS"]

# Fields every transformers config may carry that describe a checkpoint or a runtime, not an architecture.
CHECKPOINT_KEYS = frozenset({
    "architectures", "auto_map", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "model_type",
    "quantization_config", "use_cache", "initializer_range", "task_specific_params", "id2label", "label2id",
    "tokenizer_class", "attn_implementation", "_attn_implementation", "cache_implementation", "return_dict",
    "torchscript", "max_length", "output_hidden_states", "output_attentions", "problem_type",
    "chunk_size_feed_forward", "is_encoder_decoder",
})
_DROP_PATTERNS = ("dropout", "pdrop")
_STANDARD_TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
_MIN_WINDOW = 16  # a smaller "window" field is a pattern or a period, not a length in tokens
_DROP = object()


def shrink_config(config: Mapping[str, Any], review: list[str] | None = None, *,
                  derived_layer_types: Sequence[Hashable] | None = None,
                  layer_kinds: Sequence[Hashable] | None = None, config_class: type | None = None,
                  profile: TinyProfile = TINY, min_layers: int | None = None) -> dict[str, Any]:
    """A tiny version of ``config`` (a ``config.json`` dict) keeping every architecture flag.

    Sizes shrink (hidden 64, 4 heads, vocab 256, intermediate 128, 2-6 layers, 4
    experts, window 4 ...), the proportions that matter are kept (GQA stays GQA, an
    explicit ``head_dim`` stays different from hidden/heads, sizes of parts of a head
    keep their ratios), checkpoint and runtime fields are dropped. Field names are read
    through ``config_class``'s ``attribute_map`` (default: the class of the config's
    ``model_type``). ``derived_layer_types`` (the layer types the config class computes)
    and ``layer_kinds`` (a signature of each built layer) decide, with the config's own
    per-layer lists, which layers the tiny model keeps. Things a reviewer should look at
    are appended to ``review``.
    """
    return shrink_with_plan(config, review, derived_layer_types=derived_layer_types, layer_kinds=layer_kinds,
                            config_class=config_class, profile=profile, min_layers=min_layers)[0]


def shrink_with_plan(config: Mapping[str, Any], review: list[str] | None = None, *,
                     derived_layer_types: Sequence[Hashable] | None = None,
                     layer_kinds: Sequence[Hashable] | None = None, config_class: type | None = None,
                     profile: TinyProfile = TINY, min_layers: int | None = None,
                     chosen: Sequence[int] | None = None) -> tuple[dict[str, Any], LayerPlan]:
    """`shrink_config`, also returning which real layers the tiny layers stand for (`plan_layers`; ``chosen``
    names them instead)."""
    review = review if review is not None else []
    names = FieldNames.of(config_class if config_class is not None else config_class_for(config))
    source = {k: copy.deepcopy(v) for k, v in config.items()
              if k not in CHECKPOINT_KEYS and not any(p in k for p in _DROP_PATTERNS)}
    anchors = Anchors.read(source, names)
    if "text_config" in source and anchors.layers is None:
        raise DraftingError("this config nests its language model under text_config; draft a family for the "
                            "text model (its own model_type) from the text_config section instead")
    moe = has_experts(source, names)
    plan = plan_layers(source, names, anchors.layers, min_layers=min_layers or (3 if moe else 2),
                       max_layers=profile.max_layers, extra=(derived_layer_types, layer_kinds), chosen=chosen)
    if plan.kinds > profile.max_layers:
        review.append(f"the model has {plan.kinds} different kinds of layers; the tiny config keeps "
                      f"{plan.tiny_layers}: check that it covers what matters")
    shrinker = _Shrinker(Scale(profile, anchors), names, plan, moe, review, source, {})
    out = {key: shrinker.field(key, value) for key, value in source.items() if key not in plan.keyed}
    shrinker.top.update(out)
    out.update({key: shrinker.field(key, source[key]) for key in plan.keyed})
    for heads, head_size in head_pairs(source, names):
        _keep_heads_width(out, source, heads, head_size, Scale(profile, anchors))
    _keep_layer_partition(out, source, names, anchors, plan.tiny_layers)
    _match_sub_config_sizes(out)
    if "quantization_config" in config:
        review.append("the checkpoint is quantized (quantization_config); the tiny model is not.")
    return {key: value for key, value in out.items() if value is not _DROP}, plan


_SUB_CONFIG_ANCHORS = frozenset({"hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size"})


def _is_sub_config(value: Any) -> bool:
    """A mapping that is a config of its own: a ``model_type``, or two anchor sizes of its own."""
    if not isinstance(value, Mapping):
        return False
    if isinstance(value.get("model_type"), str):
        return True
    names = FieldNames.of(config_class_for(value))
    return sum(names.standard(k) in _SUB_CONFIG_ANCHORS and is_int(v) for k, v in value.items()) >= 2


def _match_sub_config_sizes(out: dict[str, Any]) -> None:
    """A size named after a sub-config (``hidden_size_global``) is that sub-config's tiny size (``global_config``)."""
    subs = {key[: -len("_config")]: value for key, value in out.items()
            if key.endswith("_config") and _is_sub_config(value)}
    for holder in [out, *subs.values()]:
        for key in list(holder):
            for name, sub in subs.items():
                anchor = key[: -len(name) - 1] if key.endswith(f"_{name}") else None
                if anchor and is_int(holder[key]) and is_int(sub.get(anchor)):
                    holder[key] = sub[anchor]


_HEAD_PAIR_WORDS = frozenset({"n", "num", "number", "heads", "head", "dim", "d", "headdim", "size"})


def _prefix(words: frozenset[str]) -> frozenset[str]:
    return words - _HEAD_PAIR_WORDS


def head_pairs(config: Mapping[str, Any], names: FieldNames) -> list[tuple[str, str]]:
    """``(heads, head size)`` field pairs other than the attention anchors (``mamba_n_heads``, ``mamba_d_head``).

    A count of heads and the size of one of them, named with the same other words: their
    product is a width (an inner dimension the class checks against ``expand * hidden``).
    """
    counts = {key: _prefix(frozenset(key.lower().split("_"))) for key, value in config.items()
              if is_int(value) and "heads" in key.lower().split("_")
              and names.standard(key) not in ("num_attention_heads", "num_key_value_heads")
              and role_of(key, value, names) == "head_count"}
    sizes = {key: _prefix(frozenset(key.lower().split("_"))) for key, value in config.items()
             if is_int(value) and {"head", "headdim"} & set(key.lower().split("_"))
             and {"dim", "d", "headdim", "size"} & set(key.lower().split("_"))}
    pairs = []
    for count, words in counts.items():
        match = [size for size, size_words in sizes.items() if size_words == words]
        if len(match) == 1:
            pairs.append((count, match[0]))
    return pairs


def _keep_heads_width(out: dict[str, Any], source: Mapping[str, Any], heads: str, head_size: str,
                      scale: Scale) -> None:
    """Make ``heads * head_size`` of the tiny config the real product scaled like the hidden size."""
    width = scale.width(source[heads] * source[head_size])
    size = out.get(head_size)
    if width is None or not is_int(size) or size <= 0 or width % size:
        return
    out[heads] = max(1, width // size)


_INDEX_WORDS = frozenset({"index", "idx", "start", "end", "first", "last"})  # a position among layers, not a count


def _keep_layer_partition(out: dict[str, Any], source: Mapping[str, Any], names: FieldNames, anchors: Anchors,
                          tiny_layers: int) -> None:
    """Counts of layers that add up to all the layers (input, looped and output layers) still do on the tiny model."""
    parts = [key for key, value in source.items()
             if is_int(value) and 0 < value < (anchors.layers or 0) and is_int(out.get(key))
             and names.standard(key) != "num_hidden_layers" and role_of(key, value, names) == "layer_count"
             and not names.words(key) & _INDEX_WORDS]
    if len(parts) < 2 or sum(source[key] for key in parts) != anchors.layers:
        return
    largest = max(parts, key=lambda key: out[key])
    rest = sum(out[key] for key in parts if key != largest)
    if tiny_layers - rest >= 1:
        out[largest] = tiny_layers - rest


@dataclass
class _Shrinker:
    scale: Scale
    names: FieldNames
    plan: LayerPlan
    moe: bool
    review: list[str]
    source: Mapping[str, Any]
    top: dict[str, Any]  # the tiny top-level values, once computed

    def field(self, key: str, value: Any) -> Any:
        """The tiny value of one field (or _DROP)."""
        role = role_of(key, value, self.names, moe=self.moe)
        if key in self.plan.index_lists:
            return self.plan.reindex(value)
        if key in self.plan.per_layer:
            return [self.scalar(key, role, v) for v in self.plan.cut(value)]
        if key in self.plan.keyed:
            return {k: self.override(v) for k, v in self.plan.rekey(value).items()}
        if role == "rope":
            return shrink_rope(value, self.scale, self.review)
        if _is_sub_config(value):  # a nested model (vision, audio, patcher ...): shrunk by its own anchors
            return shrink_config(value, self.review, profile=self.scale.profile,
                                 config_class=config_class_for(value))
        if role == "token_id":
            return self.token_id(key, value)
        return self.scalar(key, role, value)

    def override(self, settings: Any) -> Any:
        """Per-layer settings overriding top-level fields: sizes keep their ratio to the top-level value."""
        if not isinstance(settings, Mapping):
            return settings
        out = {}
        for key, value in settings.items():
            top, tiny_top = self.source.get(key), self.top.get(key)
            if is_int(value) and is_int(top) and is_int(tiny_top) and top > 0 and tiny_top != top:
                out[key] = max(1, round(value * tiny_top / top))
            else:
                out[key] = self.field(key, value)
        return out

    def token_id(self, key: str, value: Any) -> Any:
        """Token ids stay inside the tiny vocabulary (standard ids get 0/1/2, others their default)."""
        vocab = self.scale.profile.vocab
        fallback = _STANDARD_TOKEN_IDS.get(self.names.standard(key))
        if isinstance(value, list):
            kept = [v for v in value if is_int(v) and v < vocab]
            return kept or ([fallback] if fallback is not None else _DROP)
        if is_int(value) and value >= vocab:
            return fallback if fallback is not None else _DROP
        return value

    def scalar(self, key: str, role: str, value: Any) -> Any:
        """The tiny value of one integer of a field with ``role``."""
        if value is None and role == "experts_per_token" and self.moe:
            # a router needs k (topk(k=None) fails): the class left it unset, the tiny model routes to a few
            self.review.append(f"{key} is null in the config.json (a router cannot pick None experts); tiny_config "
                               f"routes each token to {self.scale.profile.experts_per_token}: set the real value")
            return self.scale.profile.experts_per_token
        if not is_int(value) or value <= 0:
            return value
        profile, scale, anchors = self.scale.profile, self.scale, self.scale.anchors
        fixed = {"hidden_size": profile.hidden, "num_attention_heads": profile.heads,
                 "num_hidden_layers": self.plan.tiny_layers, "head_dim": scale.head_dim,
                 "intermediate_size": profile.intermediate, "vocab_size": min(value, profile.vocab),
                 "experts": profile.experts if value > 1 else value, "expert_groups": 1}
        if role in fixed:
            return fixed[role]
        if role == "num_key_value_heads":
            return scale.kv_heads(value)
        if role == "kv_heads":
            return self.kv_heads(key, value)
        if role in ("max_position_embeddings", "positions"):
            return min(value, profile.positions)
        if role in ("sliding_window", "window"):
            return profile.window if value >= _MIN_WINDOW else value
        if role == "experts_per_token":
            return min(value, profile.experts_per_token)
        if role == "shared_experts":
            return min(value, 1)
        if role == "layer_count":
            return scale.layer_count(value, self.plan.tiny_layers)
        if role == "layer_pattern":
            return value
        if role == "head_count":
            return profile.heads if value == anchors.heads else (
                scale.kv_heads(value) if anchors.heads and value < anchors.heads else value)
        if role == "moe_intermediate_size":
            return scale.width(value) or value
        return self.size(key, value)

    def kv_heads(self, key: str, value: int) -> int:
        """KV heads of a field other than the anchor: when it differs from the anchor's (16 on some layer types, 8
        on the others), the tiny value keeps that ratio to the anchor's tiny value (4 and 2), so the layer types
        still cache different geometries; otherwise (or when the ratio does not fit the tiny heads) as the anchor."""
        tiny = self.scale.kv_heads(value)
        anchor = self.scale.anchors.keys.get("num_key_value_heads")
        real = self.source.get(anchor) if anchor is not None and anchor != key else None
        if not is_int(real) or real <= 0 or value == real:
            return tiny
        base, heads = self.scale.kv_heads(real), self.scale.profile.heads
        if (base * value) % real:
            return tiny
        kept = base * value // real
        return kept if 1 <= kept <= heads and heads % kept == 0 else tiny

    def size(self, key: str, value: int) -> int:
        """A field known by its value and words: a part of a head scales with the head, a width with hidden."""
        words = self.names.words(key)
        named = bool(words & SIZE_WORDS)
        if named and words & {"head", "headdim"}:
            return self.scale.head_ratio(value)
        head = self.scale.head_sized(value)
        if head is not None:
            return head
        if not named:
            return value
        return self.scale.width(value) or value
