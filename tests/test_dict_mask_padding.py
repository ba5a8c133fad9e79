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

pytestmark = pytest.mark.slow  # each test drafts a model type from its defaults: seconds on its own


@pytest.fixture(scope="module")
def zaya(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, list[Any], Path]:
    """zaya's defaults drafted and checked (asserted), its tiny config's blocks."""
    return drafted_tiny_blocks("zaya", tmp_path_factory.mktemp("zaya"))


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
