"""The pydantic model of one family file (`FamilySpec`) and its parts.

`schemas/family.schema.json` is generated from `FamilySpec` (``distconf schema``).
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from distconf.errors import ConfigValueError, excerpt
from distconf.loader.formula import Formula, FormulaError
from distconf.loader.naming import CHAIN_DELIMITER, UID_DELIMITER
from distconf.loader.spec_block import BlockSpec
from distconf.loader.spec_kv import KVCacheSpec
from distconf.loader.spec_state import StateSpec
from distconf.loader.spec_types import MAX_SPEC_INT, ClassPath, Identifier, IntOrFormula, ScalarValue, StrictModel
from distconf.loader.spec_wire import HiddenStateSpec

__all__ = ["FamilySpec", "DhtPrefixRule", "AfterLoad", "Notice", "SCHEMA_ID"]

SCHEMA_ID = "https://distconf.dev/schemas/family.schema.json"
_HUB_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$"


class DhtPrefixRule(StrictModel):
    """How ``from_pretrained`` derives the DHT prefix from a hub model id.

    The prefix is built as: take the full id (``name: full``) or its last path
    component (``name: repo``); apply ``replace`` (``.`` must always be replaced, it is
    the block-uid delimiter); append ``suffix`` (unless ``keep_existing_suffix`` and
    the name already ends with it).
    """

    name: Literal["full", "repo"] = Field(
        description="'full': the whole hub id (org/name); 'repo': only the last path component, "
                    "so copies of one model under different accounts share a swarm."
    )
    suffix: str = Field(default="", pattern=r"^[A-Za-z0-9_-]*$", description="Appended to the prefix.")
    keep_existing_suffix: bool = Field(
        default=False, description="Do not append the suffix when the prefix already ends with it."
    )
    replace: dict[str, str] = Field(
        default_factory=lambda: {".": "-"},
        description="Substring replacements; must map '.' to a string without '.'.",
    )

    @field_validator("replace")
    @classmethod
    def _dot_replaced(cls, value: dict[str, str]) -> dict[str, str]:
        if UID_DELIMITER not in value:
            raise ValueError(f"must replace {UID_DELIMITER!r} (the block uid delimiter)")
        for old, new in value.items():
            if not old:
                raise ValueError("cannot replace the empty string")
            if UID_DELIMITER in new or CHAIN_DELIMITER in new or any(c.isspace() for c in new):
                raise ValueError(f"replacement {excerpt(new)} for {excerpt(old)} may not contain {UID_DELIMITER!r} "
                                 "or whitespace")
        return value


class AfterLoad(StrictModel):
    """Fix-ups applied to a config right after ``from_pretrained`` loads it."""

    defaults: dict[Identifier, ScalarValue] = Field(
        default_factory=dict, description="Fields set to this value when they are None (e.g. pad_token_id: 0)."
    )
    set: dict[Identifier, ScalarValue] = Field(
        default_factory=dict, description="Fields always set to this value (e.g. pretraining_tp: 1)."
    )


class Notice(StrictModel):
    """A message logged by ``from_pretrained`` (licence reminders and the like)."""

    message: str = Field(min_length=1)
    when_name_contains: str | None = Field(
        default=None, min_length=1,
        description="Log only when the model name contains this text (case-insensitive); always if absent.",
    )
    level: Literal["info", "warning"] = "info"


class FamilySpec(StrictModel):
    """One model family: everything a swarm needs to know beyond the HF config."""

    family: str = Field(pattern=r"^[a-z][a-z0-9_]*$", max_length=64,
                        description="Family name; must equal the file name without .yaml.")
    display_name: str | None = Field(
        default=None, pattern=r"^[A-Z][A-Za-z0-9]*$",
        description="Used in the class name Distributed<display_name>Config (default: from family).",
    )
    model_type: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$",
                            description="The HF model_type this family serves (AutoDistributedConfig dispatch).")
    gguf_architectures: list[Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$", max_length=64)]] = Field(
        default_factory=list, max_length=16,
        description="The GGUF general.architecture names GGUF files give this family's models, where they differ "
                    "from model_type beyond '-' and '_': a GGUF file is checked against the families by its header "
                    "before it is converted.")
    config_class: ClassPath = Field(description="The Hugging Face config class to extend.")
    block: BlockSpec
    kv_groups: IntOrFormula | None = Field(
        default=None,
        description="Query heads per KV head: an integer, or a formula over config fields. Required unless "
                    "the family's layers keep a per-sequence state instead of a KV cache (`state`).",
    )
    petals_kv_groups: int | None = Field(
        default=None, ge=1, le=MAX_SPEC_INT,
        description="KV groups Petals 2.x's hand-written config uses, when it differs from kv_groups. "
                    "Informational: `distconf plan` shows what Petals' cache formula would reserve.",
    )
    kv_cache: KVCacheSpec = Field(default_factory=KVCacheSpec,
                                  description="How many values per token one block keeps in its KV cache.")
    state: StateSpec | None = Field(
        default=None,
        description="Per-sequence state (convolution / recurrent) every layer keeps instead of a KV cache, "
                    "sized per sequence rather than per token. Null: the layers keep a KV cache (kv_cache).",
    )
    hidden_state: HiddenStateSpec | None = Field(
        default=None,
        description="The hidden state between layers when it is not [batch, seq, hidden_size] (several streams); "
                    "null: one stream, hidden_size values per token on the wire.",
    )
    dht_prefix: DhtPrefixRule
    after_load: AfterLoad = Field(default_factory=AfterLoad)
    revisions: dict[str, str] = Field(
        default_factory=dict, description="Hub id -> pinned commit used when the caller gives no revision."
    )
    notices: list[Notice] = Field(default_factory=list)
    tiny_config: dict[str, Any] | None = Field(
        default=None,
        description="Config overrides for a tiny test model (used by `distconf check`): small dims, every "
                    "architecture flag that matters switched on. An optional key `variants` holds a list of "
                    "override mappings, each applied on top of the rest and checked as its own model.",
    )

    @field_validator("revisions")
    @classmethod
    def _check_revisions(cls, value: dict[str, str]) -> dict[str, str]:
        for hub_id, commit in value.items():
            if not re.match(_HUB_ID, hub_id):
                raise ValueError(f"{excerpt(hub_id)} is not a hub id of the form org/name")
            if not re.fullmatch(r"[0-9a-f]{40}", commit):
                raise ValueError(
                    f"revision of {excerpt(hub_id)} must be a 40-hex commit hash, got {excerpt(commit, 48)}")
        return value

    @model_validator(mode="wrap")
    @classmethod
    def _kv_groups_needed(cls, data: Any, handler: Any) -> Any:
        """Only a family whose layers keep a `state` may omit kv_groups: reported as the field missing, at its
        place, along with the file's other problems."""
        missing = isinstance(data, dict) and data.get("kv_groups") is None and data.get("state") is None
        problems: list[InitErrorDetails] = []
        try:
            result = handler(data)
        except ValidationError as exc:
            if not missing:
                raise
            problems = [_again(e) for e in exc.errors()]
        if missing:
            problems.append(InitErrorDetails(type="missing", loc=("kv_groups",), input=data))
            raise ValidationError.from_exception_data(cls.__name__, problems)
        return result

    @model_validator(mode="after")
    def _indexer_without_state(self) -> FamilySpec:
        if self.kv_cache.indexer_head_dim is not None and self.state is not None:
            raise ValueError("kv_cache.indexer_head_dim cannot be combined with a state section (a block's past "
                             "is (key, value, indexer) or (key, value, conv, recurrent))")
        return self

    @model_validator(mode="after")
    def _shared_kv_fits(self) -> FamilySpec:
        shared = self.kv_cache.shared
        if shared is None:
            return self
        if self.block.mask.layer_types_field is None:
            raise ValueError("kv_cache.shared needs block.mask.layer_types_field (a stored K/V is keyed by the "
                             "storing layer's type)")
        if shared.argument not in self.block.call.fresh_arguments:
            raise ValueError(f"kv_cache.shared.argument {shared.argument!r} is not a block.call.fresh_arguments "
                             "entry (the container class the block makes for each call)")
        if self.block.call.cache_argument is None or self.block.layer_stack is not None:
            raise ValueError("kv_cache.shared cannot be combined with block.call.cache_argument: null or "
                             "block.layer_stack (a block rerunning or looping its layers keeps no copy to reuse)")
        return self

    @model_validator(mode="after")
    def _cache_kinds_named(self) -> FamilySpec:
        """Every ``layer_kinds`` (state, kv_cache, rotary, computed arguments) names layer types the mask maps."""
        mask = self.block.mask
        overrides = list(self.kv_cache.layer_overrides) or None
        position = self.block.position
        named = [("state", self.state.layer_kinds if self.state else None),
                 ("kv_cache", self.kv_cache.layer_kinds), ("kv_cache.layer_overrides", overrides),
                 ("state.layer_overrides", list(self.state.layer_overrides) or None if self.state else None),
                 ("block.position.rotary", position.rotary_layer_kinds),
                 ("kv_cache.indexer", None if self.kv_cache.indexer_types_field else self.kv_cache.indexer_layer_kinds)]
        shared = self.kv_cache.shared
        if shared is not None and isinstance(shared.values_per_token, dict):
            named.append(("kv_cache.shared.values_per_token", list(shared.values_per_token)))
        named += [(f"block.position.computed_arguments.{name}", argument.layer_kinds)
                  for name, argument in position.computed_arguments.items()]
        for where, kinds in named:
            if kinds is None:
                continue
            if mask.layer_types_field is None and not mask.layer_index_fields:
                raise ValueError(f"{_kinds_field(where)} needs block.mask.layer_types_field (the config field "
                                 "listing each layer's type)")
            unknown = [k for k in kinds if k not in mask.layer_kinds and k not in mask.layer_index_fields]
            if unknown:
                mapped = ", ".join(map(repr, mask.layer_kinds))
                raise ValueError(f"{_kinds_field(where)} names {', '.join(map(repr, unknown))}, which "
                                 f"block.mask.layer_kinds does not map (it maps {mapped})")
        return self

    def kv_groups_for(self, config: object) -> int:
        """Query heads per KV head of ``config``: ``kv_groups`` (an integer, or its formula evaluated).

        Either form must give a positive integer dividing ``config.num_attention_heads``;
        raises `ConfigValueError` (quoting the values read, as short excerpts) otherwise.
        """
        value: Any = self.kv_groups
        if value is None:  # a state family: no attention heads to group
            return 1
        formula = value if isinstance(value, Formula) else None
        if formula is not None:
            try:
                value = formula.evaluate_on(config)
            except FormulaError as exc:
                raise ConfigValueError(f"family {self.family!r}: kv_groups: {exc}") from None
        heads = getattr(config, "num_attention_heads", None)
        if (isinstance(value, bool) or not isinstance(value, int) or value < 1
                or isinstance(heads, bool) or not isinstance(heads, int) or heads % value):
            seen = (", ".join(f"{k}={excerpt(v)}" for k, v in formula.values_on(config).items())
                    if formula is not None else f"num_attention_heads={excerpt(heads)}")
            raise ConfigValueError(
                f"family {self.family!r}: kv_groups {excerpt(str(self.kv_groups), 100)} gave {excerpt(value)} "
                f"with {seen}; expected a positive integer dividing num_attention_heads={excerpt(heads)}"
            )
        return value

    def tiny_kv_groups_problems(self) -> list[str]:
        """kv_groups checked against the head counts written in ``tiny_config`` (and each variant).

        Checked only where tiny_config itself gives ``num_attention_heads`` and every name
        the formula reads; other values come from the config class (checked when resolved).
        Returns one message per failing case.
        """
        tiny = self.tiny_config or {}
        base = {k: v for k, v in tiny.items() if k != "variants"}
        cases = [("tiny_config", base)]
        variants = tiny.get("variants")
        if isinstance(variants, list):
            cases += [(f"tiny_config.variants.{i}", {**base, **variant})
                      for i, variant in enumerate(variants) if isinstance(variant, dict)]
        needed = {"num_attention_heads"} | (self.kv_groups.names if isinstance(self.kv_groups, Formula) else set())
        problems = []
        for where, values in cases:
            if all(isinstance(values.get(name), (bool, int, float)) for name in needed):
                try:
                    self.kv_groups_for(SimpleNamespace(**{name: values[name] for name in needed}))
                except ConfigValueError as exc:
                    problems.append(f"with the values of {where}: {exc}")
        return problems

    @property
    def class_name(self) -> str:
        """Name of the synthesized class, ``Distributed<Name>Config``."""
        name = self.display_name or "".join(part.capitalize() for part in self.family.split("_"))
        return f"Distributed{name}Config"


def _kinds_field(where: str) -> str:
    """The field naming layer types: ``<section>.layer_kinds``, or the overrides mapping itself."""
    if where.endswith(("layer_overrides", "values_per_token")):
        return where
    return f"{where}_layer_kinds" if where.endswith((".rotary", ".indexer")) else f"{where}.layer_kinds"


def _again(error: Any) -> InitErrorDetails:
    """A pydantic error, as the details to raise it again with (its type, place, input and message kept)."""
    kind = error["type"]
    if kind not in ("missing", "extra_forbidden"):
        kind = PydanticCustomError(kind, error["msg"].replace("{", "{{").replace("}", "}}"))
    return InitErrorDetails(type=kind, loc=error["loc"], input=error.get("input"))
