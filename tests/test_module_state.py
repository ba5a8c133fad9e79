"""States a layer's modules keep in attributes of their own (``state.module_attributes``) and the token count a
block keeps for layers reading true positions (``state.counts_positions``): recurrent_gemma drafts and checks."""

from __future__ import annotations

from pathlib import Path

import pytest
from sweephelpers import draft_and_check, drafted_tiny_blocks

from distconf.cli import main


@pytest.mark.slow  # drafts a model type from its defaults: seconds on its own
def test_module_held_state_drafts_and_checks(tmp_path: Path, fresh_cache, capsys: pytest.CaptureFixture[str]) -> None:
    # before: new refused recurrent_gemma in one line ("its modules keep it themselves (RecurrentGemmaRecurrentBlock.
    # conv1d_state, ...)"): its recurrent blocks keep conv1d_state and rg_lru.recurrent_states as attributes, reset
    # them at position 0 and continue only one token at a time; its attention layers write K/V into a cache the
    # model builds itself and never returns
    import yaml

    code, draft = draft_and_check("recurrent_gemma", tmp_path)
    out = capsys.readouterr()
    spec = yaml.safe_load(draft)
    state = spec["state"]
    assert state["module_attributes"] == {"conv": ["temporal_block.conv1d_state"],
                                          "recurrent": ["temporal_block.rg_lru.recurrent_states"]}
    assert state["conv_shape"] == ["lru_width", "conv1d_width - 1"] and state["recurrent_shape"] == ["lru_width"]
    assert state["counts_positions"] is True and state["continuation"] == "one_token"
    assert state["recurrent_dtype"] == "float32" and state["layer_kinds"] == ["linear_attention"]
    assert spec["kv_cache"]["layer_kinds"] == ["sliding_attention"]
    assert spec["block"]["mask"]["layer_kinds"] == {"linear_attention": "none", "sliding_attention": "sliding_window"}
    assert spec["block"]["call"]["extra"] == {"use_cache": True}
    assert spec["block"]["attention_class"].endswith("RecurrentGemmaAttention")
    assert "TODO review" not in draft
    assert code == 0, out.err


@pytest.mark.slow  # drafts a model type from its defaults: seconds on its own
def test_check_fails_without_the_token_count(tmp_path: Path, fresh_cache, capsys: pytest.CaptureFixture[str]) -> None:
    """Without ``counts_positions`` the recurrent layers see position 0 at every step and reset: check fails."""
    import yaml

    _, draft = draft_and_check("recurrent_gemma", tmp_path)
    spec = yaml.safe_load(draft)
    del spec["state"]["counts_positions"]
    spec["family"] = "recurrent_gemma_uncounted"
    path = tmp_path / "recurrent_gemma_uncounted.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    capsys.readouterr()
    assert main(["check", str(path)]) != 0
    assert "token-by-token outputs with the KV cache differ" in capsys.readouterr().err


@pytest.mark.slow  # drafts a model type from its defaults: seconds on its own
def test_blocks_with_module_held_state_step_like_the_model(tmp_path: Path, fresh_cache) -> None:
    """The drafted blocks: each layer's output, any split into steps, a beam reorder, a refused rewind, a restart
    (a failover's replay); the modules hold nothing between calls."""
    import torch
    from blockhelpers import record_layers
    from sessionhelpers import session_with_beam_and_restart, steps

    from distconf.blocks.layer_types import keeps_state_at
    from distconf.blocks.sizing import state_bytes_per_sequence
    from distconf.blocks.state import state_geometry

    config, model, blocks, _ = drafted_tiny_blocks("recurrent_gemma", tmp_path)
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for block, (inputs, outputs) in zip(blocks, record_layers(model, config, ids, use_cache=False), strict=True):
            torch.testing.assert_close(block(inputs)[0], outputs, rtol=1e-5, atol=1e-5)
    hidden = torch.randn(2, 9, config.hidden_size, generator=torch.Generator().manual_seed(1))
    whole, pasts = steps(blocks, hidden, [9])
    state_layer = next(i for i in range(config.num_hidden_layers) if keeps_state_at(config, i))
    geometry = state_geometry(config, state_layer)
    conv, recurrent, count = pasts[state_layer]
    assert tuple(conv.shape[1:]) == geometry.conv_shape and tuple(recurrent.shape[1:]) == geometry.recurrent_shape
    assert recurrent.dtype == torch.float32 and count.dtype == torch.long and count.tolist() == [[9], [9]]
    assert state_bytes_per_sequence(config, torch.bfloat16, state_layer) == \
        2 * geometry.conv_values + 4 * geometry.recurrent_values + 8
    temporal = blocks[state_layer].temporal_block
    assert temporal.conv1d_state is None and temporal.rg_lru.recurrent_states is None  # nothing left behind
    for sizes in ([1] * 9, [4, 2, 1, 2], [3, 6], [1, 8]):
        stepped, _ = steps(blocks, hidden, sizes)
        torch.testing.assert_close(stepped, whole, rtol=1e-5, atol=1e-5)
    session_with_beam_and_restart(config, blocks)


def test_module_attributes_name_one_attribute_per_state() -> None:
    from pydantic import ValidationError

    from distconf.loader.spec_state import StateSpec

    with pytest.raises(ValidationError, match=r"names 2 attributes, state\.conv_shape declares 1"):
        StateSpec(conv_shape=[4, 3], recurrent_shape=[4],
                  module_attributes={"conv": ["a.conv_state", "b.conv_state"], "recurrent": ["a.state"]})
    with pytest.raises(ValidationError, match="pattern"):
        StateSpec(recurrent_shape=[4], module_attributes={"recurrent": ["block._parameters"]})
    with pytest.raises(ValidationError, match="returned_tuple cannot be set besides"):
        StateSpec(recurrent_shape=[4], returned_tuple=True, module_attributes={"recurrent": ["block.state"]})
    spec = StateSpec(conv_shape=[4, 3], recurrent_shape=[4], counts_positions=True,
                     module_attributes={"conv": ["conv_state"], "recurrent": ["rnn.state"]})
    assert spec.width == 3 and spec.slots == (1, 1)


def test_layers_keeping_different_attributes_are_not_drafted() -> None:
    """Two state layers keeping their states under different attribute paths: no module_attributes (the drafter
    then refuses the model in one line, as before)."""
    import torch

    from distconf.tools.drafting.state_module_attributes import module_states

    first, second = torch.nn.Module(), torch.nn.Module()
    first.conv_state, second.rnn_state = torch.zeros(1, 4, 3), torch.zeros(1, 4)
    assert module_states([first, second], 1, []) == (None, [])
    second.conv_state, second.rnn_state = torch.zeros(1, 4, 3), None
    found, states = module_states([first, second], 1, [])
    assert found is not None and found.conv == ("conv_state",) and found.recurrent == ()
    assert [s.conv for s in states] == [(4, 3), (4, 3)]
