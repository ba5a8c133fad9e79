"""A model whose layers take the token ids and a dict of rotary embeddings, as the sweep found deepseek_v4.

Its decoder layer takes ``input_ids`` (a hash-routed MoE picks experts by token), a ``{"main", "compress"}``
dict of rotary embeddings, and the mask, positions and cache through ``**kwargs``; its cache layers are
the model's own classes (a compressor's running state). The drafter writes ``hidden_state.carried`` with
``initial: token_ids`` (the ids travel on the wire as base-256 digits), ``block.position.rotary_keys``, and
``block.call.cache_argument: null`` (the block keeps its inputs, carried ids included, and reruns them).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401  (first imported outside capsys: its log handler keeps the session's stderr)
from blockhelpers import hf_model, record_layers, save_checkpoint
from sweephelpers import drafted_fixture

from distconf.blocks.weights import load_block
from distconf.blocks.wire import CarriedSlot, carried_layout, token_id_digits, token_ids_of
from distconf.loader import load_family
from distconf.loader.spec_position import PositionSpec
from distconf.loader.spec_wire import CarriedStream
from distconf.loader.wire_layout import wire_layout
from distconf.tools.checker import tiny_variants

pytestmark = pytest.mark.slow  # each test drafts a model type from its defaults: seconds on its own


drafted = drafted_fixture("deepseek_v4")
"""``distconf new`` + ``distconf check`` of deepseek_v4's defaults: (check's exit code, the draft)."""


def test_deepseek_v4_defaults_draft_and_check(drafted: tuple[int, Path]) -> None:
    """before: the draft mapped no layer kind, passed no token ids and no rotary dict, and check failed."""
    code, draft = drafted
    text = draft.read_text()
    assert code == 0
    assert "cache_argument: null" in text
    assert "rotary_keys:\n      main: main\n      compress: compress" in text
    assert "- argument: input_ids\n    width: 3\n    initial: token_ids" in text  # 129280 ids: 3 digits
    assert "TODO" not in text


def test_token_ids_are_exact_on_a_bf16_wire() -> None:
    """Every id of a 129280-token vocabulary survives the wire in bf16; an id past the digits is refused."""
    ids = torch.tensor([[0, 1, 255, 256, 65535, 65536, 129279]])
    digits = token_id_digits(ids, 3, torch.bfloat16)
    assert digits.shape == (1, 7, 3) and digits.dtype == torch.bfloat16
    assert torch.equal(token_ids_of(digits), ids)
    assert not torch.equal(token_ids_of(token_id_digits(ids, 3, torch.float32)[..., 1:]), ids)
    with pytest.raises(ValueError, match="do not fit in 2 base-256 digits"):
        token_id_digits(ids, 2, torch.float32)


def test_knobs_refuse_what_they_cannot_mean() -> None:
    """token_ids are never returned by a layer; a returned value needs its index; rotary_keys needs the module."""
    assert CarriedStream(argument="input_ids", width=3, initial="token_ids").output_index is None
    with pytest.raises(ValueError, match="exactly one of output_index"):
        CarriedStream(argument="input_ids", width=3, initial="token_ids", output_index=1)
    with pytest.raises(ValueError, match="exactly one of output_index"):
        CarriedStream(argument="carried", width=3)
    with pytest.raises(ValueError, match="rotary_keys needs rotary_class"):
        PositionSpec(rotary_keys={"main": "main"})
    with pytest.raises(ValueError, match="excludes rotary_layer_type_argument"):
        PositionSpec(rotary_class="transformers.A", rotary_keys={"main": "main"}, rotary_layer_type_argument=True)


@pytest.fixture(scope="module")
def chain(drafted: tuple[int, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object, list[object]]:
    """(distributed config, HF model with a random token -> expert table, its loaded float32 blocks)."""
    cls = load_family(drafted[1])
    _, values = tiny_variants(cls.family_spec.tiny_config)[0]
    config = cls(**values)
    model = hf_model(cls.hf_config_class(**values))
    generator = torch.Generator().manual_seed(7)
    tables = [m for m in model.modules() if hasattr(m, "tid2eid")]
    assert tables  # a hash-routed layer: the experts follow the token ids
    for module in tables:
        module.tid2eid.copy_(torch.randint(0, module.num_experts, module.tid2eid.shape, generator=generator))
    folder = tmp_path_factory.mktemp("deepseek_v4_ckpt")
    save_checkpoint(model, folder)
    blocks = [load_block(folder, config, i, dtype=torch.float32) for i in range(config.num_hidden_layers)]
    return config, model, blocks


def _wire(config: object, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    (entry,) = carried_layout(config)
    return torch.cat([hidden.flatten(-2), token_id_digits(ids, entry.width, hidden.dtype)], dim=-1)


def test_blocks_route_by_the_carried_ids_token_by_token(chain: tuple[object, object, list[object]]) -> None:
    """The chain of blocks, one token per step (each recomputing its kept inputs), equals the model with a
    non-trivial token -> expert table; other ids on the wire give another result (the router reads them)."""
    config, model, blocks = chain
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    records = record_layers(model, config, ids)
    expected = records[-1][1].flatten(-2)
    with torch.no_grad():
        wire, pasts = _wire(config, records[0][0], ids), [None] * len(blocks)
        outputs = []
        for t in range(ids.shape[1]):
            step = wire[:, t:t + 1]
            for i, block in enumerate(blocks):
                step, pasts[i] = block(step, layer_past=pasts[i], use_cache=True)
            outputs.append(step)
        stepped = torch.cat(outputs, dim=1)
        other = _wire(config, records[0][0], (ids + 1) % config.vocab_size)
        for block in blocks:
            other, _ = block(other)
    width = expected.shape[-1]
    assert torch.allclose(stepped[..., :width], expected, atol=1e-5, rtol=1e-4)
    assert torch.equal(token_ids_of(stepped[..., width:]), ids)  # each block hands the ids on unchanged
    assert not torch.allclose(other[..., :width], expected, atol=1e-3)


def test_client_stand_in_puts_the_ids_on_the_wire(chain: tuple[object, object, list[object]]) -> None:
    """The client's layer stand-in sends the ids the model's loop hands its layers, and returns the hidden state
    alone (the layers return no ids)."""
    from distconf.client.layer_fit import carried_arguments
    from distconf.client.model import RemoteLayers

    config, model, _ = chain
    layer = model.model.layers[0]
    carried = carried_arguments(layer, config)
    assert carried == ((CarriedSlot("input_ids", 3, None, None, 1, "token_ids"), 0),)  # first after the hidden states
    stand_in = RemoteLayers(None, {}, wire_layout(config), carried=carried)  # type: ignore[arg-type]
    assert stand_in.streams == config.hc_mult
    hidden = torch.randn(1, 4, config.hc_mult, config.hidden_size)
    ids = torch.tensor([[9, 200, 3, 17]])
    wire = torch.cat([hidden.flatten(-2), *stand_in._carried_inputs(hidden.flatten(-2), (), {"input_ids": ids})],
                     dim=-1)
    assert torch.equal(token_ids_of(wire[..., -3:]), ids)
    stand_in.probing = True
    assert torch.equal(stand_in(hidden, input_ids=ids), hidden)
    with pytest.raises(ValueError, match="need the token ids as input_ids"):
        stand_in(hidden)


def test_a_layer_type_named_for_another_list_is_noted_not_crashed(drafted: tuple[int, Path]) -> None:
    """before: check's layer-kind listing crashed (KeyError: 'moe') building a layer of type 'moe', a value of
    mlp_layer_types the modeling code names; the model itself refuses it, so it is a note."""
    from distconf.tools.checker.kinds import check_coverage

    kinds = check_coverage(load_family(drafted[1]))
    assert not kinds.missing
    assert any("'moe'" in note and "does not run it" in note for note in kinds.notes)
