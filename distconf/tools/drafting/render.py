"""`FamilyDraft`: a first draft of a family file, rendered as YAML with review comments."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FamilyDraft", "DEFAULT_SCHEMA_REFERENCE"]

DEFAULT_SCHEMA_REFERENCE = "../schemas/family.schema.json"


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
    modules_field: str | None = None  # the config field counting layer modules that hold sublayers
    config_section: str | None = None  # the config field holding the sub-config sizing the served layer stack
    layer_classes: dict[str, str] = field(default_factory=dict)  # layer type -> its own decoder-layer class
    attention_classes: dict[str, str] = field(default_factory=dict)  # layer type -> its layers' attention class
    skipped_layer_kinds: list[str] = field(default_factory=list)  # layer types the model skips for ids alone
    model_buffers: dict[str, str] = field(default_factory=dict)  # buffer path in a layer -> function making it
    attn_implementation: str = "sdpa"
    constructor: dict[str, Any] = field(default_factory=dict)
    call: dict[str, Any] = field(default_factory=dict)
    position: dict[str, Any] = field(default_factory=dict)
    mask: dict[str, Any] = field(default_factory=dict)
    kv_groups: int | str = 1
    kv_cache: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    keeps_kv: bool = True  # some layer keeps K/V (a pure state family writes no kv_groups)
    hidden_state: dict[str, Any] = field(default_factory=dict)  # several streams between layers (hidden_streams)
    layer_stack: dict[str, Any] = field(default_factory=dict)  # a looped range of layers (drafting.layer_stack)
    tiny_config: dict[str, Any] = field(default_factory=dict)
    dht_prefix: dict[str, Any] = field(default_factory=lambda: {"name": "repo"})
    facts: list[str] = field(default_factory=list)
    review: list[str] = field(default_factory=list)
    layer_parameters: dict[str, Any] = field(default_factory=dict)
    """The layers' ``forward`` parameters (every layer class's), for the rules after ``call``; not written."""
    undecided: list[str] = field(default_factory=list)
    """Why a drafting rule decided nothing (its probe run failed); not written into the family file, where
    the run of the tiny config reports the failure itself (`distconf.tools.drafting.rules`)."""

    def to_yaml(self, schema_path: str = DEFAULT_SCHEMA_REFERENCE) -> str:
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
        lines.append(_dump({"block": self._block()}))
        if self.keeps_kv or not self.state:
            lines.append(f"kv_groups: {_scalar(self.kv_groups)}")
        if self.kv_cache:
            lines.append(_dump({"kv_cache": self.kv_cache}))
        if self.state:
            lines.append(_dump({"state": self.state}))
        if self.hidden_state:
            lines.append(_dump({"hidden_state": self.hidden_state}))
        lines.append(_dump({"dht_prefix": self.dht_prefix}))
        if self.tiny_config:
            lines.append(_dump({"tiny_config": self.tiny_config}))
        return "\n".join(line.rstrip() for line in lines) + "\n"

    def _block(self) -> dict[str, Any]:
        block: dict[str, Any] = {
            "layer_class": self.layer_class,
            **({"layer_classes": self.layer_classes} if self.layer_classes else {}),
            **({"skipped_layer_kinds": self.skipped_layer_kinds} if self.skipped_layer_kinds else {}),
            "attention_class": self.attention_class or "transformers.TODO_AttentionClass",
            **({"attention_classes": self.attention_classes} if self.attention_classes else {}),
            "prefix": self.prefix,
            **({"modules_field": self.modules_field} if self.modules_field else {}),
            **({"config_section": self.config_section} if self.config_section else {}),
        }
        if self.base_model_prefix:
            block["base_model_prefix"] = self.base_model_prefix
        if self.attn_implementation != "sdpa":
            block["attn_implementation"] = self.attn_implementation
        if self.model_buffers:
            block["model_buffers"] = self.model_buffers
        for key in ("constructor", "call", "position", "mask", "layer_stack"):
            value = getattr(self, key)
            if value:
                block[key] = value
        return block


def _comment_lines(text: str) -> list[str]:
    return ["# " + line for line in textwrap.wrap(text, width=88, subsequent_indent="  ")]


def _scalar(value: Any) -> str:
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("...").strip()


def _dump(mapping: Mapping[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(dict(mapping), default_flow_style=False, sort_keys=False, width=100).rstrip()
