"""Gemma 3n's text model: streams first between layers (``hidden_state.stream_axis: 0``) and K/V shared across
layers (``kv_cache.shared``).

Its layers take and return AltUp's ``[altup_num_inputs, batch, seq, hidden_size]``, and its last
``num_kv_shared_layers`` layers attend with the K/V the last earlier layer of their type stored in a container
the model hands every layer. The drafter writes both from transformers' defaults; blocks carry the stored K/V of
each step's new tokens on the wire, a reusing block keeps its own copy; check proves it against transformers and
names a missing or wrong section; two servers, the storing layers on one and the reusing ones on the other,
generate what the local model does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sweephelpers import new_from_defaults

from distconf.cli import main

FAMILY = "gemma3n_shared"  # its own name: the sweep's tests may draft gemma3n_text in the same worker
SHARED = ("kv_cache:\n  shared:\n    argument: shared_kv_states\n    modes_field: kv_sharing_modes\n"
          "    values_per_token: 2 * num_key_value_heads * head_dim\n")
STREAMS = ("hidden_state:\n  streams: altup_num_inputs\n  stream_axis: 0\n"
           "  collapse_module: model.altup_unembed_projections\n")


@pytest.fixture(scope="module")
def drafted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gemma3n")
    assert new_from_defaults("gemma3n_text", folder, family=FAMILY) == 0
    return folder / "out" / f"{FAMILY}.yaml"


def _edited(drafted: Path, folder: Path, name: str, edit: Any) -> Path:
    family = f"{FAMILY}_{name}"
    path = folder / f"{family}.yaml"
    path.write_text(edit(drafted.read_text()).replace(f"family: {FAMILY}\n", f"family: {family}\n"))
    return path


def _check(path: Path) -> Any:
    from distconf.loader import load_family
    from distconf.tools.checker import CheckResult
    from distconf.tools.checker.run import check_variant

    cls = load_family(path)
    result = CheckResult(cls.family_spec.family, "tiny")
    check_variant(cls, {k: v for k, v in cls.family_spec.tiny_config.items() if k != "variants"}, result)
    return result


def test_the_drafter_writes_streams_first_and_the_shared_kv(drafted: Path) -> None:
    text = drafted.read_text()
    assert SHARED in text and STREAMS in text
    assert "right only while no layer reads" not in text  # the fresh container's caveat no longer holds


def test_streams_first_round_trip_the_wire() -> None:
    import torch

    from distconf.blocks.wire import to_layer_form, to_wire_form

    layer = torch.arange(4 * 2 * 3 * 5, dtype=torch.float32).reshape(4, 2, 3, 5)  # [streams, batch, seq, hidden]
    wire = to_wire_form(layer, 4, axis=0)
    assert wire.shape == (2, 3, 20) and torch.equal(wire[1, 2, 5:10], layer[1, 1, 2])
    assert torch.equal(to_layer_form(wire, 4, axis=0), layer)
    with pytest.raises(ValueError, match=r"\[4, \.\.\., hidden\]"):
        to_wire_form(layer.movedim(0, 2), 4, axis=0)


def test_the_wire_carries_the_stored_kv(drafted: Path) -> None:
    from distconf.loader import load_family
    from distconf.loader.kv_sharing import layer_sharing, shared_kv_slots

    cls = load_family(drafted)
    config = cls(**cls.family_spec.tiny_config)
    slots = shared_kv_slots(config)
    per_kv = 2 * config.num_key_value_heads * config.head_dim
    assert [s.key for s in slots] == ["full_attention", "sliding_attention"] and {s.width for s in slots} == {per_kv}
    per_layer = config.num_hidden_layers * config.hidden_size_per_layer_input
    assert config.wire_width == 4 * config.hidden_size + per_layer + 2 * per_kv
    roles = [layer_sharing(config, i).role for i in range(config.num_hidden_layers)]
    assert roles == [None, "store", "store", "reuse", "reuse", "reuse"]  # the last non-shared layer of each type


def test_blocks_with_shared_kv_equal_the_model(drafted: Path) -> None:
    result = _check(drafted)  # full sequence, one-token steps, chunks, the whole chain
    assert result.full_diff is not None and result.full_diff < 1e-5
    assert result.incremental_diff is not None and result.incremental_diff < 1e-5


@pytest.mark.parametrize(("name", "edit", "where"), [
    ("axis", lambda text: text.replace("  stream_axis: 0\n", ""), "hidden_state.stream_axis: is 2, but"),
    ("unshared", lambda text: text.replace(SHARED, ""), "block.call.fresh_arguments: KeyError"),
    ("width", lambda text: text.replace("values_per_token: 2 * ", "values_per_token: "),
     "kv_cache.shared.values_per_token: layer 1: the storing layer's keys"),
])
def test_check_names_a_wrong_or_missing_section(drafted: Path, tmp_path: Path, name: str, edit: Any,
                                                 where: str) -> None:
    from distconf.tools.checker.run import check_family

    (result,) = check_family(_edited(drafted, tmp_path, name, edit))
    assert result.failure is not None and where in str(result.failure), result.failure


def test_the_container_must_be_a_fresh_argument(drafted: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = _edited(drafted, tmp_path, "container", lambda t: t.replace("argument: shared_kv_states",
                                                                      "argument: kv_store"))
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert "kv_cache.shared.argument 'kv_store' is not a block.call.fresh_arguments entry" in err
    assert "Traceback" not in err


def test_a_reusing_block_caches_the_stored_kv(drafted: Path) -> None:
    import torch

    from distconf.blocks.build import block_class_for, constructor_kwargs
    from distconf.loader import load_family

    cls = load_family(drafted)
    config = cls(**cls.family_spec.tiny_config)
    block = block_class_for(config)(**constructor_kwargs(config, 4)).eval()  # reuses sliding_attention's K/V
    wire = torch.randn(1, 3, config.wire_width)
    with torch.no_grad():
        out, past = block(wire, use_cache=True)
        _, past = block(wire[:, :1], layer_past=past, use_cache=True)
    heads, dim = config.num_key_value_heads, config.head_dim
    assert past[0].shape == (1, heads, 4, dim)  # the stored keys of every token so far, its own copy
    stored = wire[..., -2 * heads * dim:]  # sliding_attention's part, stored second (layer 2), last on the wire
    assert torch.equal(past[0][:, :, :3], stored[..., :heads * dim].unflatten(-1, (heads, dim)).transpose(1, 2))
    assert torch.equal(out[..., -4 * heads * dim:], wire[..., -4 * heads * dim:])  # handed on unchanged


@pytest.mark.swarm
def test_generation_through_servers_equals_the_local_model(drafted: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from span_swarm import SpanSwarm, assert_failover_keeps_the_tokens, assert_generation_equals_local

    from distconf.loader.search import FAMILIES_PATH_ENV

    monkeypatch.setenv(FAMILIES_PATH_ENV, str(drafted.parent))  # the servers find the drafted family too
    per_layer = {"layer_types": ["sliding_attention", "full_attention"] * 2, "intermediate_size": [128] * 4,
                 "activation_sparsity_pattern": [0.0] * 4, "num_kv_shared_layers": 2}

    # layers 0 and 1 store (one server), 2 and 3 reuse (the other): the K/V crosses servers on the wire
    with SpanSwarm(tmp_path, FAMILY, layers=4, **per_layer) as swarm:
        model = swarm.model()
        assert (model.remote_layers.streams, model.remote_layers.stream_axis) == (4, 0)
        assert_generation_equals_local(model, swarm.local, swarm.servers, seeds=(1,))
        assert_failover_keeps_the_tokens(swarm)  # the server of blocks 2..3 is killed: its history is replayed


def test_gemma4_shares_kv_of_two_geometries(tmp_path: Path) -> None:
    """Gemma 4's full-attention layers keep other K/V sizes (its config's sizes per layer): the stored K/V of
    each type is as wide as its storing layer's, with one formula read on each layer's own config."""
    from transformers import AutoConfig

    AutoConfig.for_model("gemma4_text", num_kv_shared_layers=10).save_pretrained(tmp_path / "config")
    out = tmp_path / "out"
    assert main(["new", "gemma4_shared", "--from-config", str(tmp_path / "config"), "--out", f"{out}/"]) == 0
    text = (out / "gemma4_shared.yaml").read_text()
    assert SHARED in text and "TODO" not in text
    assert main(["check", str(out / "gemma4_shared.yaml")]) == 0
