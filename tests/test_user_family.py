"""A user adds an architecture that is not built in, with a YAML file only, and it all works."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import forkserver
import pytest
import transformers

from distconf import AutoDistributedConfig, list_families, load_family

REPO = Path(__file__).resolve().parents[1]

# OLMo 2 (QK-norm, post-norm residuals) is not a built-in family.
OLMO2_FAMILY = """\
# yaml-language-server: $schema=../schemas/family.schema.json
family: olmo2
model_type: olmo2
config_class: transformers.Olmo2Config
block:
  layer_class: transformers.models.olmo2.modeling_olmo2.Olmo2DecoderLayer
  attention_class: transformers.models.olmo2.modeling_olmo2.Olmo2Attention
  prefix: model.layers
  base_model_prefix: model
  position:
    rotary_class: transformers.models.olmo2.modeling_olmo2.Olmo2RotaryEmbedding
kv_groups: num_attention_heads // num_key_value_heads
dht_prefix:
  name: repo
tiny_config:
  vocab_size: 256
  hidden_size: 64
  intermediate_size: 128
  num_hidden_layers: 3
  num_attention_heads: 4
  num_key_value_heads: 2
  max_position_embeddings: 128
"""


@pytest.mark.slow
def test_user_family_end_to_end(tmp_path, monkeypatch, fresh_cache) -> None:
    assert "olmo2" not in list_families()
    families = tmp_path / "my_families"
    families.mkdir()
    (families / "olmo2.yaml").write_text(OLMO2_FAMILY, encoding="utf-8")
    monkeypatch.setenv("DISTCONF_FAMILIES_PATH", str(families))

    cls = load_family("olmo2")
    assert cls.__name__ == "DistributedOlmo2Config" and issubclass(cls, transformers.Olmo2Config)
    assert cls.attn_class is transformers.models.olmo2.modeling_olmo2.Olmo2Attention

    transformers.Olmo2Config(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                             hidden_size=64).save_pretrained(tmp_path / "model")
    cfg = AutoDistributedConfig.from_pretrained(tmp_path / "model", dht_prefix="olmo-test")
    assert type(cfg) is cls and cfg.num_key_value_groups == 4
    assert cfg.block_uids() == ["olmo-test.0", "olmo-test.1"]

    env = {**os.environ, "DISTCONF_FAMILIES_PATH": str(families)}
    for args in (["validate", "--resolve", str(families)], ["check", "olmo2"]):
        out = forkserver.run([sys.executable, "-m", "distconf", *args], env=env, cwd=tmp_path, timeout=600)
        assert out.returncode == 0, (args, out.stdout, out.stderr)
