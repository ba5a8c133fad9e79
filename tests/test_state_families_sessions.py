"""The state-keeping families falcon_mamba, qwen3_next and lfm2, block by block against transformers.

Each tiny model's blocks equal the model's layers in any step sizes, and a server session over
them (prefill, decode steps, beam search's hypo_ids reordering K/V and state rows, a refused
rewind, a restart) computes what the blocks compute in one go: falcon_mamba's mamba-1 mixer
(conv + SSM state on every layer, one-token continuation), qwen3_next's gated-DeltaNet layers
(conv + delta-rule state) between attention layers, lfm2's conv layers (a conv window only, no
recurrent state) between attention layers.
"""

from __future__ import annotations

import pytest
import torch
from blockhelpers import record_layers
from sessionhelpers import session_with_beam_and_restart, steps
from test_hybrid_blocks import _tiny

from distconf.blocks.layer_types import keeps_kv_at, keeps_state_at
from distconf.blocks.sizing import state_bytes_per_sequence

KINDS = {  # per tiny layer: (keeps K/V, keeps a state)
    "falcon_mamba": [(False, True)] * 2,
    "qwen3_next": [(False, True), (True, False), (False, True)],
    "lfm2": [(False, True), (True, False), (False, True)],
}


@pytest.fixture(scope="module", params=sorted(KINDS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, object, object, list]:
    """A tiny model of the family, saved, and its blocks loaded from the checkpoint."""
    family = request.param
    return (family, *_tiny(family, tmp_path_factory.mktemp(family)))


def test_layers_keep_what_the_family_says(tiny: tuple) -> None:
    family, config, _, blocks = tiny
    n = config.num_hidden_layers
    assert [(keeps_kv_at(config, i), keeps_state_at(config, i)) for i in range(n)] == KINDS[family]
    _, pasts = steps(blocks, torch.randn(2, 5, config.hidden_size), [5])
    for i, past in enumerate(pasts):
        if keeps_state_at(config, i):
            held = sum(t.numel() * t.element_size() for t in past if t is not None) // 2  # per sequence
            assert held == state_bytes_per_sequence(config, torch.float32, i), (family, i)


def test_blocks_equal_the_model_layers_in_anysteps(tiny: tuple) -> None:
    _, config, model, blocks = tiny
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    records = record_layers(model, config, ids, use_cache=False)
    with torch.no_grad():
        for block, (inputs, outputs) in zip(blocks, records):
            torch.testing.assert_close(block(inputs)[0], outputs, rtol=1e-5, atol=1e-5)
    whole, _ = steps(blocks, records[0][0], [9])
    torch.testing.assert_close(whole, records[-1][1], rtol=1e-5, atol=1e-5)
    for sizes in ([1] * 9, [4, 2, 1, 2]):
        stepped, _ = steps(blocks, records[0][0], sizes)
        torch.testing.assert_close(stepped, whole, rtol=1e-5, atol=1e-5)


def test_a_session_with_beam_reordering_and_a_restart(tiny: tuple) -> None:
    _, config, _, blocks = tiny
    session_with_beam_and_restart(config, blocks)
