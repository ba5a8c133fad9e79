"""The drafter's rules over the tiny model's probe runs: declared dependencies, one build per tiny config, and a
rule that cannot decide saying why."""

from __future__ import annotations

import pytest

from distconf.tools.drafting import probe
from distconf.tools.drafting.render import FamilyDraft
from distconf.tools.drafting.rules import TINY_RULES, Rule, TinyFacts, apply_rules, check_order

_TINY_LLAMA = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
               "num_hidden_layers": 2, "vocab_size": 32, "max_position_embeddings": 16}


def _llama_config_class() -> type:
    from transformers import LlamaConfig

    return LlamaConfig


def test_every_rule_comes_after_the_rules_it_needs() -> None:
    from distconf.tools.drafting.model_rules import MODEL_RULES

    check_order(MODEL_RULES)
    model_rules = {rule.name: rule for rule in MODEL_RULES}
    assert all(need in model_rules for rule in MODEL_RULES for need in rule.needs)
    with pytest.raises(ValueError, match="'position' needs call"):
        check_order([r for r in MODEL_RULES if r.name != "call"])
    check_order(TINY_RULES)
    by_name = {rule.name: rule for rule in TINY_RULES}
    assert all(need in by_name for rule in TINY_RULES for need in rule.needs)
    swapped = [by_name["dict_mask"] if r.name == "call_inputs" else by_name["call_inputs"] if r.name == "dict_mask"
               else r for r in TINY_RULES]
    with pytest.raises(ValueError, match="'dict_mask' needs call_inputs"):
        check_order(swapped)
    with pytest.raises(ValueError, match="listed twice"):
        check_order([*TINY_RULES, TINY_RULES[0]])


def test_a_tiny_config_is_built_once_per_draft_and_each_probe_run_made_once(monkeypatch: pytest.MonkeyPatch
                                                                              ) -> None:
    builds = []
    build = probe._build

    def counted(*args, meta, **kwargs):
        builds.append(meta)
        return build(*args, meta=meta, **kwargs)

    monkeypatch.setattr(probe, "_build", counted)
    config_class = _llama_config_class()
    with probe.probe_session():
        cached = probe.observe(config_class, _TINY_LLAMA, "eager", probe.CACHED_RUN)
        again = probe.observe(config_class, dict(_TINY_LLAMA), "eager", probe.CACHED_RUN)
        uncached = probe.observe(config_class, _TINY_LLAMA, "eager", probe.UNCACHED_RUN)
        _, first = probe.tiny_model(config_class, _TINY_LLAMA, "eager")
        _, second = probe.tiny_model(config_class, _TINY_LLAMA, "eager")
    assert builds == [False]  # one float32 build, every caller a copy of it
    assert again is cached and uncached is not cached and first is not second
    assert [call.index for call in cached.calls] == [0, 1] and cached.error is None
    assert all(a.equal(b) for a, b in zip(first.parameters(), second.parameters(), strict=True))


def test_a_copy_of_the_build_runs_as_a_fresh_build() -> None:
    import torch

    config_class = _llama_config_class()
    _, fresh = probe.tiny_model(config_class, _TINY_LLAMA, "eager")  # no session: a build
    fresh_ids = torch.randint(0, 8, (1, 5))
    with probe.probe_session():
        probe.tiny_model(config_class, _TINY_LLAMA, "eager")
        torch.manual_seed(123)  # whatever ran in between, a copy comes with the generator as the build left it
        _, copied = probe.tiny_model(config_class, _TINY_LLAMA, "eager")
        copied_ids = torch.randint(0, 8, (1, 5))
    assert copied_ids.equal(fresh_ids)
    with torch.no_grad():
        assert copied(copied_ids).logits.equal(fresh(fresh_ids).logits)


def test_a_rule_whose_probe_run_fails_says_why_in_the_undecided_notes() -> None:
    class Refusing(_llama_config_class()):  # type: ignore[misc]
        def __init__(self, **kwargs):
            raise ValueError("no tiny model for this test")

    def reads_a_probe(facts: TinyFacts, draft: FamilyDraft) -> None:
        record = probe.observe(facts.config_class, facts.tiny, draft.attn_implementation, probe.CACHED_RUN)
        assert record.error == "ValueError: no tiny model for this test" and not record.built

    draft = FamilyDraft(family="x", model_type="llama", config_class="c", layer_class="l", attention_class=None,
                        prefix="model.layers", base_model_prefix="model")
    facts = TinyFacts(Refusing, _TINY_LLAMA, object)
    with probe.probe_session():
        apply_rules([Rule("reads_a_probe", (), reads_a_probe)], facts, draft)
    (note,) = draft.undecided
    assert note.startswith("reads_a_probe: not decided, the tiny model does not build for its probe")
    assert note.endswith("ValueError: no tiny model for this test")
    assert "no tiny model" not in draft.to_yaml()  # the family file is as before; the run of tiny_config says it


def test_distconf_new_lists_the_parts_it_could_not_draft(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import LlamaConfig

    from distconf.cli import main

    build = probe._build

    def float_build_fails(config_class, tiny, attn_implementation, *, meta):
        if not meta:  # the tiny model of the probe runs (the meta scan still works)
            raise RuntimeError("the tiny model ran out of memory")
        return build(config_class, tiny, attn_implementation, meta=meta)

    monkeypatch.setattr(probe, "_build", float_build_fails)
    LlamaConfig(**_TINY_LLAMA).save_pretrained(tmp_path / "config")
    out_folder = str(tmp_path / "out") + "/"
    assert main(["new", "undrafted", "--from-config", str(tmp_path / "config"), "--out", out_folder]) == 0
    out = capsys.readouterr().out
    assert "part(s) not drafted" in out
    assert ("  - layer_stack: not decided, the tiny model does not build for its probe (a 1x6-token float32 forward "
            "without a cache)") in out
    assert "RuntimeError: the tiny model ran out of memory" in out
