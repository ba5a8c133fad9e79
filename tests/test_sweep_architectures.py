"""benchmarks/sweep_architectures.py: exclusions from transformers' metadata, the failure classes, the child runner."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
import yaml

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "sweep_architectures.py"


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("sweep_architectures", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def data(sweep):
    return yaml.safe_load(sweep.DATA.read_text(encoding="utf-8"))


def test_every_type_is_swept_or_excluded_with_a_reason(sweep, data) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal

    types, excluded = sweep.swept_types(data)
    assert sorted(types + list(excluded)) == sorted(causal)
    assert all(reason.strip() for reason in excluded.values())
    assert excluded["gpt-sw3"].startswith("alias") and "gpt2" in types
    assert excluded["bart"].startswith("encoder-decoder") and excluded["bert"].startswith("bidirectional")
    assert excluded["gemma3"].startswith("multimodal wrapper") and "gemma3_text" in types
    assert "reformer" in types and "mllama" in types  # kept; a text model without its own causal-LM type


@pytest.mark.parametrize(("text", "cause"), [
    ("'BlockKVCache' object has no attribute 'get_conv_state'", "recurrent_state"),
    ("  - no *Attention module inside MambaBlock; set attention_class by hand", "recurrent_state"),
    ("'BlockKVCache' object has no attribute 'update_indexer'", "caches_beyond_kv"),
    ("no ModuleList of 128 layers", "layer_stack"),
    ("mat1 and mat2 shapes cannot be multiplied (2x64 and 256x24)", "hidden_not_bsh"),
    ("forward() got an unexpected keyword argument 'cache'", "call_convention"),
    ("layer 2 is a Inkling2FullDecoderLayer, not Inkling2SlidingDecoderLayer", "layer_class_per_type"),
    ("KeyError: 'full_attention'", "positions_outside"),
    ("blocks cache 4 KV heads but the family declares 2", "kv_geometry"),
    ("AttributeError: 'Spec' object has no attribute 'family_source'", "tool_bug"),
    ("distconf new: transformers cannot build the model of this config.json (...)", "defaults_do_not_build"),
    ("something nobody has seen", "unclassified"),
])
def test_issue_errors_fall_in_their_class(sweep, data, text: str, cause: str) -> None:
    assert sweep.classify(text, [], data["classes"])[0] == cause


def test_config_hints_class_an_unmatched_failure(sweep, data) -> None:
    hints = ["hidden_size", "layer_types=full_attention", "layer_types=linear_attention"]
    assert sweep.classify("x [tiny]: shapes differ", hints, data["classes"])[0] == "recurrent_state"
    assert sweep.classify("x [tiny]: shapes differ", ["hidden_size"], data["classes"])[0] == "unclassified"


def test_first_error_is_the_checkers_line_else_the_raised_exception(sweep) -> None:
    out = "table\nfam: layer kinds not listed\n"
    err = "[transformers] noise\nfam [tiny]: fam.yaml:3:1: block.x: wrong\n"
    assert sweep.first_error(out, err, "fam")[0] == "fam [tiny]: fam.yaml:3:1: block.x: wrong"
    trace = "Traceback (most recent call last):\n  File \"x\", line 1\nValueError: bad value\n"
    assert sweep.first_error("", trace, "fam") == ("ValueError: bad value", ["traceback"])
    assert sweep.first_error(out, "", "fam")[0] == "fam: layer kinds not listed"


@pytest.mark.slow  # a few seconds: kept out of make test-fast
def test_a_child_over_its_timeout_is_stopped_with_its_group(sweep, tmp_path) -> None:
    start = time.monotonic()
    cmd = [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
           "'import time; time.sleep(60)']); print('started', flush=True); time.sleep(60)"]
    rc, out, _ = sweep.run_child(cmd, 2.0, tmp_path, tmp_path)
    assert rc is None and "started" in out
    assert time.monotonic() - start < 30


def test_reclassify_reads_the_step_logs_again(sweep, data, tmp_path) -> None:
    folder = tmp_path / "fam"
    folder.mkdir()
    (folder / "check.log").write_text("$ distconf check\nrc=1\ntable\n--- stderr\n"
                                      "fam [tiny]: f.yaml:1:1: block: no ModuleList of 8 layers\n", "utf-8")
    record = {"model_type": "fam", "status": "fail", "stage": "check", "cause": "unclassified", "error": "?"}
    result = tmp_path / "result.json"
    result.write_text(json.dumps({"workdir": str(tmp_path), "partial": False, "results": [record]}), "utf-8")
    meta, outcomes = sweep.reclassify(result, data["classes"], 60.0)
    assert meta == {"workdir": str(tmp_path), "partial": False}
    assert outcomes[0].cause == "layer_stack"
    assert outcomes[0].error == "fam [tiny]: f.yaml:1:1: block: no ModuleList of 8 layers"


@pytest.mark.slow  # a few seconds: kept out of make test-fast
def test_a_draft_failing_on_defaults_transformers_cannot_build_is_theirs(sweep, data, tmp_path) -> None:
    folder = tmp_path / "dbrx"
    folder.mkdir()
    assert sweep.write_defaults("dbrx", folder) == ""
    outcome = sweep.Outcome("dbrx", "fail", stage="new")
    sweep.explain(outcome, "", "Traceback (most recent call last):\nAttributeError: no rope_theta\n", "", folder,
                  data["classes"], 120.0)
    assert outcome.cause == "defaults_do_not_build"
    assert any("meta-device build" in item for item in outcome.evidence)


def test_a_repair_sets_fields_and_merges_sub_configs(sweep) -> None:
    from sweep_repairs import Repair

    repair = Repair("dbrx", {"why": "no rope_theta", "set": {"attn_config": {"rope_theta": 5}, "head_dim": 8}})
    config = {"attn_config": {"kv_n_heads": 1}, "head_dim": None, "hidden_size": 64}
    assert repair.apply(config) == {"attn_config": {"kv_n_heads": 1, "rope_theta": 5}, "head_dim": 8,
                                    "hidden_size": 64}
    assert config["head_dim"] is None  # the defaults themselves are left as they are
    with pytest.raises(ValueError, match=r"repairs\.x\.why"):
        Repair("x", {"set": {"a": 1}})
    with pytest.raises(ValueError, match=r"repairs\.x\.set"):
        Repair("x", {"why": "because", "set": {}})


def test_every_repair_is_for_a_swept_type_whose_defaults_do_not_build(sweep, data) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    types, _ = sweep.swept_types(data)
    repairs = sweep.read_repairs(data)
    assert repairs and set(repairs) <= set(types)
    for model_type in repairs:
        with torch.device("meta"), pytest.raises(Exception):  # noqa: B017 (any error: transformers' own)
            AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type))


@pytest.mark.slow  # about 15 s: kept out of make test-fast
def test_lfm2_moe_passes_once_its_defaults_are_repaired(sweep, data, tmp_path) -> None:
    """The repaired defaults draft and check. Its layer_types is a list the config class does not derive, so
    `check` stretches it to list the layer kinds at full depth (it used to drop it and fail)."""
    from distconf.cli import main

    assert sweep.write_defaults("lfm2_moe", tmp_path) == ""
    config = sweep.write_repaired(tmp_path / "config.json", sweep.read_repairs(data)["lfm2_moe"], tmp_path / "fixed")
    assert main(["new", "lfm2_moe", "--from-config", str(config), "--out", str(tmp_path / "out") + "/"]) == 0
    assert main(["check", str(tmp_path / "out" / "lfm2_moe.yaml")]) == 0
