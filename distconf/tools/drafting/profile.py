"""The sizes of a tiny model (`TinyProfile`) and the real-to-tiny scale of each kind of field."""

from __future__ import annotations

from dataclasses import dataclass

from distconf.tools.drafting.common import is_int
from distconf.tools.drafting.fields import Anchors

__all__ = ["TinyProfile", "TINY", "PROBE", "Scale", "TINY_TEST_TOKENS"]

TINY_TEST_TOKENS = 12  # tokens the drafter runs through the tiny model


@dataclass(frozen=True)
class TinyProfile:
    """Target sizes of a tiny model; proportions of the real model are kept around them."""

    hidden: int = 64
    heads: int = 4
    vocab: int = 256
    intermediate: int = 128
    window: int = 4  # smaller than the 7 tokens `distconf check` runs, so a wrong mask shows
    positions: int = 128
    experts: int = 4
    experts_per_token: int = 2
    max_layers: int = 6


TINY = TinyProfile()
# A second, differently shaped tiny model: a formula that gives the right cache size on
# both is not a coincidence of the tiny sizes.
PROBE = TinyProfile(hidden=128, heads=8)


@dataclass(frozen=True)
class Scale:
    """Real -> tiny sizes of one config under one profile."""

    profile: TinyProfile
    anchors: Anchors

    @property
    def head_dim(self) -> int:
        """Tiny size of one head: hidden / heads, twice that when the real head_dim differs from it."""
        natural = self.profile.hidden // self.profile.heads
        real = self.anchors
        if real.head_dim is not None and real.natural_head_dim is not None and real.head_dim != real.natural_head_dim:
            return 2 * natural
        return natural

    def kv_heads(self, value: int) -> int:
        """Tiny KV heads: MHA stays MHA, MQA stays MQA, grouped stays grouped (at least 2 KV heads)."""
        heads, tiny = self.anchors.heads, self.profile.heads
        if not heads or value >= heads:
            return tiny
        if value <= 1:
            return 1
        groups = max(2, heads // value)
        kv = max(1, tiny // groups)
        while tiny % kv:
            kv -= 1
        return max(2, kv) if tiny % 2 == 0 else kv

    def head_sized(self, value: int) -> int | None:
        """``value`` scaled like one head (exactly, and at least 2), or None when it does not scale so."""
        real = self.anchors.head_size
        if not real or not 2 <= value <= real or (value * self.head_dim) % real:
            return None
        tiny = value * self.head_dim // real
        return tiny if tiny >= 2 else None

    def head_ratio(self, value: int) -> int:
        """``value`` scaled by tiny / real head size, rounded to an even number (at least 2)."""
        real = self.anchors.head_size
        if not real:
            return value
        exact = value * self.head_dim / real
        return int(exact) if exact == int(exact) and exact >= 2 else max(2, round(exact / 2) * 2)

    def width(self, value: int) -> int | None:
        """``value`` scaled like the hidden size (rounded to a multiple of 4, at least 4)."""
        hidden = self.anchors.hidden
        if not hidden or not is_int(value) or value <= 0:
            return None
        return max(4, round(value * self.profile.hidden / hidden / 4) * 4)  # rows of 16 bytes in float32

    def layer_count(self, value: int, tiny_layers: int) -> int:
        """A count or index of layers: all layers stay all, a part stays a part (at least one of each)."""
        real = self.anchors.layers
        if not real or value < tiny_layers:
            return value
        if value >= real:
            return tiny_layers
        return min(max(1, round(value * tiny_layers / real)), tiny_layers - 1)
