"""Hybrid layers the model assembles from shared modules (zamba, zamba2) draft and check (issue 23).

Each layer of type hybrid wraps a transformer block the model shares between layers (tied tensors), a linear
and a Mamba layer; every layer gets its own index and the embeddings besides the hidden states. The drafter
takes the layers from the model (``block.constructor.from_model``), passes the index
(``block.call.layer_idx_argument``) and carries the embeddings on the wire (``hidden_state.carried`` with
``initial: hidden`` and no output index); tied tensors load from the layer transformers saved them under.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from sweephelpers import draft_and_check

pytestmark = pytest.mark.slow  # each test drafts a model type from its defaults: seconds on its own


@pytest.fixture(scope="module")
def zamba(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], Path]:
    """zamba's defaults drafted and checked once: (check's exit code, the draft, its folder)."""
    folder = tmp_path_factory.mktemp("zamba")
    code, text = draft_and_check("zamba", folder)
    return code, yaml.safe_load(text), folder


def test_zamba_drafts_and_checks(zamba: tuple[int, dict[str, Any], Path]) -> None:
    # before: distconf new failed ("ZambaHybridLayer(shared_transf, linear, mamba) is not built from the config")
    code, draft, _ = zamba
    block = draft["block"]
    assert block["constructor"] == {"from_model": True}
    assert block["layer_classes"] == {"hybrid": "transformers.models.zamba.modeling_zamba.ZambaHybridLayer"}
    assert block["attention_class"].endswith(".ZambaAttention")
    assert block["call"]["layer_idx_argument"] == "layer_idx"
    assert block["call"]["mask_argument"] == "causal_mask"  # attention_mask holds the Mamba layers' padding
    assert draft["hidden_state"] == {"carried": [{"argument": "original_hidden_states", "width": "hidden_size",
                                                  "initial": "hidden"}]}
    assert code == 0


def test_zamba_state_heads_split_the_width(zamba: tuple[int, dict[str, Any], Path]) -> None:
    # before: the recurrent state's head size was a sum of four fields equal to it on the tiny models only
    # (256 on the real config instead of 3712); a product divided by a field is now a candidate
    _, draft, _ = zamba
    assert draft["state"]["recurrent_shape"] == ["n_mamba_heads", "hidden_size * mamba_expand // n_mamba_heads",
                                                 "mamba_d_state"]


def test_tied_tensors_load_from_the_layer_transformers_saved(zamba: tuple[int, dict[str, Any], Path]) -> None:
    import torch
    from blockhelpers import hf_model, save_checkpoint

    from distconf.blocks.checkpoint import Checkpoint
    from distconf.blocks.weights import load_block
    from distconf.loader import load_family

    _, _, folder = zamba
    cls = load_family(next((folder / "out").glob("*.yaml")))
    values = {k: v for k, v in cls.family_spec.tiny_config.items() if k != "variants"}
    hybrid = [i for i, t in enumerate(values["layers_block_type"]) if t == "hybrid"]
    assert len(hybrid) >= 2  # the tiny model keeps a layer tied to another and the one it is tied to
    model = hf_model(cls.hf_config_class(**values))
    save_checkpoint(model, folder / "ckpt")
    with Checkpoint(folder / "ckpt") as checkpoint:
        names = list(checkpoint.names)
    assert not any(n.startswith(f"model.layers.{hybrid[1]}.shared_transf.") for n in names)
    config = cls(**values)
    block = load_block(folder / "ckpt", config, hybrid[1], dtype=torch.float32)
    assert block.distconf_tied
    weight = block.shared_transf.self_attn.q_proj.weight
    assert torch.equal(weight, model.model.layers[hybrid[0]].shared_transf.self_attn.q_proj.weight)
    assert torch.equal(block.linear.weight, model.model.layers[hybrid[1]].linear.weight)  # its own, untied


def test_the_kinds_check_reads_layer_types_under_its_alias(zamba: tuple[int, dict[str, Any], Path]) -> None:
    # before: a type the modeling code names (full_attention) counted as a kind the family must build, as the
    # tiny config's layers_block_type (ZambaConfig's layer_types) was not read; the model refuses it
    from distconf.loader import load_family
    from distconf.tools.checker.named_kinds import model_refuses_layer_type, named_layer_type_configs

    _, _, folder = zamba
    cls = load_family(next((folder / "out").glob("*.yaml")))
    values = {k: v for k, v in cls.family_spec.tiny_config.items() if k != "variants"}
    configs = named_layer_type_configs(cls, [("tiny", cls.hf_config_class(**values))])
    named = {name.split("'")[1]: config for name, config in configs}
    assert "full_attention" in named
    refusal = model_refuses_layer_type(cls, named["full_attention"]) or ""
    # transformers' own words: "... conv state ..." (5.24), "Cannot get recurrent state ..." (5.25)
    assert "conv state" in refusal or "recurrent state" in refusal, refusal


def test_untie_layer_list_lets_the_client_drop_the_layers() -> None:
    import torch
    from transformers import ZambaConfig, ZambaForCausalLM

    from distconf.blocks.hf_compat import untie_layer_list

    config = ZambaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
                         num_hidden_layers=4, vocab_size=64, n_mamba_heads=2, mamba_dt_rank=4,
                         layers_block_type=["linear_attention", "hybrid", "hybrid", "linear_attention"])

    def stand_in_model(untie: bool) -> Any:
        with torch.device("meta"):
            model = ZambaForCausalLM(config)
        model.model.layers = torch.nn.ModuleList([torch.nn.Identity()])  # the client's stand-in for the list
        if untie:
            untie_layer_list(model, "model.layers")
        return model

    with pytest.raises(Exception, match="shared_transf"):  # the ties name layers that are not there
        stand_in_model(untie=False).tie_weights()
    model = stand_in_model(untie=True)
    model.tie_weights()
    assert not any("layers" in k or "layers" in v for k, v in model.all_tied_weights_keys.items())
    assert model.all_tied_weights_keys  # the embeddings' tie stays


def test_a_carried_value_without_output_index_passes_through() -> None:
    import torch

    from distconf.blocks.wire import CarriedSlot, join_carried, split_carried
    from distconf.loader.spec_wire import CarriedStream

    stream = CarriedStream(argument="original_hidden_states", width="hidden_size", initial="hidden")
    assert stream.output_index is None and stream.computed_by is None
    with pytest.raises(ValueError, match="neither output_index nor computed_by"):
        CarriedStream(argument="original_hidden_states", width="hidden_size", initial="hidden", output_index=1)
    layout = (CarriedSlot("original_hidden_states", 3, None, None, 1, "hidden"),)
    wire = torch.arange(2 * 7, dtype=torch.float32).reshape(1, 2, 7)
    hidden, carried = split_carried(wire, layout)
    out = join_carried(hidden * 2, hidden * 2, layout, carried)  # the layer returns the hidden states only
    assert torch.equal(out[..., 4:], wire[..., 4:]) and torch.equal(out[..., :4], wire[..., :4] * 2)


def test_the_client_model_carries_the_embeddings_to_the_blocks(zamba: tuple[int, dict[str, Any], Path],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # the client's model drops its layer list (and the ties naming it); its stand-in puts the embeddings the
    # model hands the layers on the wire: the blocks run in place of the swarm give the model's own logits
    import torch
    from blockhelpers import hf_model, save_checkpoint

    import distconf.client.model as client_model
    from distconf.blocks.checkpoint import Checkpoint
    from distconf.blocks.weights import load_block
    from distconf.loader import load_family

    _, _, folder = zamba
    cls = load_family(next((folder / "out").glob("*.yaml")))
    values = {k: v for k, v in cls.family_spec.tiny_config.items() if k != "variants"}
    config = cls(**values)
    model = hf_model(cls.hf_config_class(**values))
    save_checkpoint(model, folder / "client-ckpt")
    blocks = [load_block(folder / "client-ckpt", config, i, dtype=torch.float32)
              for i in range(config.num_hidden_layers)]

    class LocalBlocks(torch.nn.Module):
        """The swarm's blocks, run here."""

        def __init__(self, *args: Any) -> None:
            super().__init__()

        def forward(self, hidden: torch.Tensor, prompts: Any = None) -> torch.Tensor:
            for block in blocks:
                hidden, _ = block(hidden)
            return hidden

    monkeypatch.setattr(client_model, "RemoteSequential", LocalBlocks)
    with Checkpoint(folder / "client-ckpt") as checkpoint:
        client = client_model.build_model(config, checkpoint, None, torch.float32)
    ids = torch.randint(0, 200, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = client(input_ids=ids, use_cache=False).logits, model(input_ids=ids, use_cache=False).logits
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5)
