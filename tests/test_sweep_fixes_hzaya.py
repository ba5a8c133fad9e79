"""A layer that takes its attention mask as a dict of masks (``block.mask.as_dict``), pinned end to end on zaya.

zaya's model hands each layer ``attention_mask={"causal": <the layer's causal mask>, "conv": <the 2D padding
mask>}``: its attention reads the first, its convolutional q/k projection zeroes padded tokens with the second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from sweephelpers import drafted_tiny_blocks

from distconf.blocks.layer_settings import RowLayout


@pytest.fixture(scope="module")
def zaya(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, list[Any], Path]:
    """zaya's defaults drafted and checked (asserted), its tiny config's blocks."""
    return drafted_tiny_blocks("zaya", tmp_path_factory.mktemp("zaya"))


def test_dict_mask_is_drafted_and_checked(zaya: tuple[Any, Any, list[Any], Path]) -> None:
    # before: blocks gave the layer one tensor mask; its attention does `attention_mask or {}`, so every cached
    # run crashed ("Boolean value of Tensor with more than one value is ambiguous")
    text = zaya[3].read_text()
    assert "    as_dict:\n      causal: attention\n      conv: padding\n" in text


def test_padded_tokens_are_zeroed_before_the_convolution(zaya: tuple[Any, Any, list[Any], Path]) -> None:
    # a row left-padded within the call: its real tokens' outputs equal the row's alone only when the layer's
    # 'conv' entry zeroes the padding (otherwise the padded tokens' values reach them through the convolution)
    config, _, blocks, _ = zaya
    width = config.hidden_size + config.router_hidden_size  # the wire: hidden state, then the router states
    generator = torch.Generator().manual_seed(0)
    alone = torch.randn(1, 4, width, generator=generator)
    batch = torch.randn(2, 6, width, generator=generator) * 10
    batch[0, 2:] = alone[0]
    padding = torch.ones(2, 6, dtype=torch.bool)
    padding[0, :2] = False
    rows = RowLayout(padding, (padding.long().cumsum(-1) - 1).clamp(min=0))
    with torch.no_grad():
        for block in blocks:
            together, _ = block(batch, rows=rows)
            single, _ = block(alone)
            torch.testing.assert_close(together[0, 2:], single[0], rtol=1e-5, atol=1e-5)


def test_dict_mask_needs_the_mask_keyword() -> None:
    from pydantic import ValidationError

    from distconf.loader.spec_block import BlockSpec

    with pytest.raises(ValidationError, match=r"mask\.as_dict needs call\.mask_argument"):
        BlockSpec.model_validate({"layer_class": "transformers.A", "attention_class": "transformers.B",
                                  "prefix": "model.layers", "call": {"mask_argument": None},
                                  "mask": {"as_dict": {"causal": "attention"}}})
