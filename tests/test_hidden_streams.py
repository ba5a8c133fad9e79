"""``hidden_state``: layers that hand each other several streams of hidden_size values (hy_v4's hyper-connections).

hy_v4 expands its embedding output to ``hc_mult`` streams, every layer takes and returns
``[batch, seq, hc_mult, hidden_size]``, and ``model.hc_head`` collapses the streams before the final
norm. The drafter finds the section, the wire carries ``hc_mult * hidden_size`` values per token
(`distconf.loader.wire_layout.wire_width_of`), the blocks reshape around the layer, and check proves
the blocks against transformers in that wide form. Some tiny models here give every layer its own
sparse-attention indexer (``indexer_types`` all ``full``), so that nothing but the streams is at stake;
hy_v4's ``shared`` layers (top-k indices carried from the layer before) are tests/test_carried_arguments.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sweephelpers import new_from_defaults

from distconf.cli import main

FAMILY = "hy_v4_streams"  # its own name: another test may draft hy_v4 in the same worker
SECTION = "hidden_state:\n  streams: hc_mult\n  collapse_module: model.hc_head\n"


def _draft(folder: Path) -> Path:
    assert new_from_defaults("hy_v4", folder, family=FAMILY) == 0
    return folder / "out" / f"{FAMILY}.yaml"


def _own_indexers(values: dict[str, Any]) -> dict[str, Any]:
    """The tiny config with every layer running its own indexer."""
    return {**values, "indexer_types": ["full"] * len(values["indexer_types"])}


@pytest.fixture(scope="module")
def drafted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _draft(tmp_path_factory.mktemp("hy_v4"))


def test_the_drafter_writes_the_streams_and_the_collapse_module(drafted: Path) -> None:
    assert SECTION in drafted.read_text()


def test_the_wire_carries_every_stream(drafted: Path) -> None:
    import distconf
    from distconf.loader import load_family
    from distconf.planning import autograd_reserve_bytes, batch_activation_bytes

    cls = load_family(drafted)
    config = cls(**cls.family_spec.tiny_config)
    assert (config.hc_mult, config.hidden_size, config.wire_width) == (2, 64, 128)
    plain = distconf.load_family("llama")()
    assert plain.wire_width == plain.hidden_size
    wide = batch_activation_bytes(config, 1, 1, 0, "fp32", 0)
    config.hc_mult = 1  # the same model with one stream: activations and reserve shrink
    assert batch_activation_bytes(config, 1, 1, 0, "fp32", 0) < wide
    assert autograd_reserve_bytes(config) * 2 == autograd_reserve_bytes(cls(**cls.family_spec.tiny_config))


def test_the_streams_must_be_a_positive_count(drafted: Path, tmp_path: Path) -> None:
    bad = tmp_path / f"{FAMILY}_zero.yaml"
    bad.write_text(drafted.read_text().replace("  streams: hc_mult\n", "  streams: 0\n")
                   .replace(f"family: {FAMILY}\n", f"family: {FAMILY}_zero\n"))
    assert main(["validate", str(bad)]) == 1


def test_blocks_on_the_wide_wire_equal_the_model(drafted: Path) -> None:
    from distconf.loader import load_family
    from distconf.tools.checker import CheckResult
    from distconf.tools.checker.run import check_variant

    cls = load_family(drafted)
    base = {k: v for k, v in cls.family_spec.tiny_config.items() if k != "variants"}
    result = CheckResult(FAMILY, "tiny")
    check_variant(cls, _own_indexers(base), result)  # full sequence, one-token steps, chunks, the whole chain
    assert result.full_diff is not None and result.full_diff < 1e-5
    assert result.incremental_diff is not None and result.incremental_diff < 1e-5


@pytest.mark.parametrize(("name", "edit", "where"), [
    ("wrong", lambda text: text.replace("  streams: hc_mult\n", "  streams: 3\n"),
     "hidden_state.streams: gives 3 streams"),
    ("missing", lambda text: text.replace(SECTION, ""),
     "hidden_state: the model's layers take a 2x9x2x64 hidden state"),
])
def test_check_names_a_wrong_or_missing_section(drafted: Path, tmp_path: Path, name: str, edit: Any,
                                                 where: str) -> None:
    from distconf.loader import load_family
    from distconf.tools.checker import CheckResult
    from distconf.tools.checker.failures import CheckFailure
    from distconf.tools.checker.run import check_variant

    family = f"{FAMILY}_{name}"
    path = tmp_path / f"{family}.yaml"
    path.write_text(edit(drafted.read_text()).replace(f"family: {FAMILY}\n", f"family: {family}\n"))
    cls = load_family(path)
    base = {k: v for k, v in cls.family_spec.tiny_config.items() if k != "variants"}
    with pytest.raises(CheckFailure, match=where.replace("(", r"\(")):
        check_variant(cls, _own_indexers(base), CheckResult(FAMILY, "tiny"))


def test_prompt_tuning_is_refused_in_one_line(drafted: Path) -> None:
    from distconf.client.ptune import prompt_tuning_for
    from distconf.loader import load_family

    cls = load_family(drafted)
    config = cls(**cls.family_spec.tiny_config, pre_seq_len=2, tuning_mode="ptune")
    with pytest.raises(ValueError, match=r"not supported .*hidden_state\.streams"):
        prompt_tuning_for(config, None)


@pytest.mark.swarm
def test_generation_through_servers_equals_the_local_model(drafted: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from span_swarm import SpanSwarm, assert_failover_keeps_the_tokens, assert_generation_equals_local

    from distconf.loader.search import FAMILIES_PATH_ENV

    monkeypatch.setenv(FAMILIES_PATH_ENV, str(drafted.parent))  # the servers find the drafted family too
    per_layer = {"layer_types": ["indexed_attention"] * 4, "indexer_types": ["full", "shared", "full", "shared"],
                 "mlp_layer_types": ["dense", "sparse", "dense", "sparse"]}

    with SpanSwarm(tmp_path, FAMILY, layers=4, **per_layer) as swarm:
        model = swarm.model()
        assert model.remote_layers.streams == 2
        assert_generation_equals_local(model, swarm.local, swarm.servers, seeds=(1,))
        assert_failover_keeps_the_tokens(swarm)  # the server of blocks 2..3 is killed: its history is replayed
