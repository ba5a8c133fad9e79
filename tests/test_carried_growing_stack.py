"""Layers reading a stack of earlier layers' inputs, as the architecture sweep found them on inkling2_text.

Its layer loop starts ``block_states`` empty and, after every ``n_layers_per_attn_res_block``-th layer, appends
that layer's input; every layer reads the whole stack so far, and the model's ``final_input`` reads it after the
last layer. Blocks carry the whole stack on the wire after the hidden state (``hidden_state.carried[].grows``:
``ceil(num_hidden_layers / every)`` entries, zeros until made) and append to it themselves. Its layers also take
each query's distance to each key (``block.position.relative_distance_argument``), position ids through
``**kwargs``, and its full-attention layers are a class of their own holding another attention class
(``block.attention_classes``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401  (first imported outside capsys: its log handler keeps the session's stderr)
import yaml
from blockhelpers import hf_model, save_checkpoint
from sweephelpers import drafted_fixture

from distconf.blocks.weights import load_block
from distconf.cli import main
from distconf.loader import load_family
from distconf.loader.registry import clear_cache
from distconf.loader.wire_layout import wire_layout

pytestmark = pytest.mark.slow  # each test drafts a model type from its defaults: seconds on its own


drafted = drafted_fixture("inkling2_text")
"""``distconf new`` + ``distconf check`` of inkling2_text's defaults: (check's exit code, the draft)."""


def test_inkling2_defaults_draft_and_check(drafted: tuple[int, Path]) -> None:
    """before: ``distconf new`` refused: "gives each layer block_states, a stack of every earlier layer's hidden
    states ... no family file can serve this model"."""
    code, draft = drafted
    family = yaml.safe_load(draft.read_text())
    assert code == 0
    assert family["hidden_state"]["carried"] == [{
        "argument": "block_states", "width": "hidden_size",
        "grows": {"every": "n_layers_per_attn_res_block", "read_by": "model.final_input"}}]
    assert family["tiny_config"]["n_layers_per_attn_res_block"] == 2  # layers that append and layers that do not
    assert family["block"]["position"]["relative_distance_argument"] == "relative_distance"
    assert "position_ids_argument" not in family["block"].get("call", {})
    assert family["block"]["attention_class"].endswith(".Inkling2SlidingAttention")
    assert family["block"]["attention_classes"] == {
        "hybrid": "transformers.models.inkling2.modeling_inkling2.Inkling2FullAttention"}


def test_the_wire_holds_the_whole_stack_on_the_real_defaults(drafted: tuple[int, Path]) -> None:
    """48 layers appending every 6th input: 8 entries of 4608 after the hidden state."""
    from transformers import AutoConfig

    real = AutoConfig.for_model("inkling2_text")
    config = load_family(drafted[1])(**real.to_dict())
    assert config.wire_width == real.hidden_size * (1 + 8)


def test_the_client_hands_the_blocks_stack_to_final_input(drafted: tuple[int, Path], tmp_path: Path) -> None:
    """The model's loop around the client's one stand-in, the drafted tiny blocks behind it, and final_input given
    the stack the blocks returned (`hand_final_stacks`): the logits are the model's own."""
    from distconf.client.layer_fit import carried_arguments, hand_final_stacks, plain_attributes
    from distconf.client.model import RemoteLayers

    cls = load_family(drafted[1])
    tiny = {k: v for k, v in cls.family_spec.tiny_config.items() if k != "variants"}
    tiny["num_hidden_layers"], tiny["layer_types"] = 5, ["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid",
                                                         "hybrid_sliding"]
    config = cls(**tiny)
    model = hf_model(cls.hf_config_class(**tiny))
    save_checkpoint(model, tmp_path / "ckpt")
    blocks = [load_block(tmp_path / "ckpt", config, i, dtype=torch.float32) for i in range(5)]
    input_ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(input_ids=input_ids, use_cache=False).logits

        def chain(wire: torch.Tensor) -> torch.Tensor:
            for block in blocks:
                wire, _ = block(wire)
            return wire

        layers = model.model.layers
        stand_in = RemoteLayers(chain, plain_attributes(layers[0]), wire_layout(config),  # type: ignore[arg-type]
                                carried_arguments(layers[0], config))
        model.model.layers = torch.nn.ModuleList([stand_in])
        without = model(input_ids=input_ids, use_cache=False).logits  # the loop's own stack: the embeddings only
        hand_final_stacks(model, config, stand_in)
        got = model(input_ids=input_ids, use_cache=False).logits
    assert stand_in.stacks["block_states"].shape == (2, 7, 3, config.hidden_size)  # inputs of layers 0, 2, 4
    assert not torch.allclose(without, expected, atol=1e-3)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_a_wrong_growth_rule_fails_at_its_field(drafted: tuple[int, Path], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Appending after every layer (every: 1) is not the stack the model hands the next layer."""
    text = drafted[1].read_text().replace("every: n_layers_per_attn_res_block", "every: 1")
    draft = tmp_path / "inkling2_text.yaml"
    draft.write_text(text)
    clear_cache()
    capsys.readouterr()
    assert main(["check", str(draft)]) == 1
    out = capsys.readouterr()
    clear_cache()
    line = next(x for x in (out.out + out.err).splitlines() if x.startswith("inkling2_text ["))
    assert "hidden_state.carried.0.grows.every" in line and "block_states after layer" in line, line
