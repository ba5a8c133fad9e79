"""`DistributedConfig`: the type every later layer annotates a synthesized config with.

A synthesized ``Distributed<Name>Config`` is a Hugging Face config (its family's base class)
plus the mixins of `distconf.loader.mixins` plus what synthesis installs (`family_spec`,
`family_source`, `hf_config_class`, `block_class`, `attn_class`). No single Python class
spells all of that, so consumers used to write ``config: Any``; this protocol names what
they may rely on, so a reader (and a type checker) sees which object a function takes.

It is a structural type: an instance of any synthesized class satisfies it, checked at
runtime by ``isinstance(config, DistributedConfig)`` (attribute presence only). Fields a
given Hugging Face base may lack (``num_key_value_heads``, ``head_dim``) are read through the
family's formulas, never directly, and so are not part of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    from distconf.loader.source import FamilySource
    from distconf.loader.spec import FamilySpec

__all__ = ["DistributedConfig"]


@runtime_checkable
class DistributedConfig(Protocol):
    """A synthesized distributed config (an instance of a class made by `distconf.load_family`)."""

    family_spec: ClassVar[FamilySpec]
    family_source: ClassVar[FamilySource]
    hf_config_class: ClassVar[type]

    model_type: str
    num_hidden_layers: int
    hidden_size: int
    wire_width: int  # values per token between blocks (`distconf.loader.wire_layout.wire_width_of`)
    vocab_size: int
    # ClientConfig
    initial_peers: list[str] | tuple[str, ...]
    dht_prefix: str | None
    request_timeout: float
    max_retries: int | None
    min_backoff: float
    max_backoff: float
    ban_timeout: float
    active_adapter: str | None
    verify_fraction: float
    verify_tolerance: float | None
    weights_manifest: str | None
    # PTuneConfig
    pre_seq_len: int
    tuning_mode: str | None
    # LMHeadConfig
    use_chunked_forward: bool | str
    chunked_forward_step: int

    def block_uids(self, start: int = 0, end: int | None = None) -> list[str]:
        """The DHT uids of blocks ``start..end``."""
        ...

    def to_dict(self) -> dict[str, Any]:
        """The config as Hugging Face serializes it."""
        ...
