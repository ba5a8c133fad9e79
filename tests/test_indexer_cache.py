"""A sparse-attention indexer's key cache next to K/V (``kv_cache.indexer_head_dim``), on a real tiny
deepseek_v32 model: the family proves it with ``distconf check``, and a server's session keeps it per token,
reorders its rows for beam search, and is computed alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distconf.tools.checker import check_family


def _family(tmp_path: Path, with_indexer: bool = True) -> Path:
    """The drafter's deepseek_v32 file (it maps the layer type and declares the indexer), with a tiny indexer that
    selects 4 keys of 9 (with enough heads that its ReLU scores do not tie)."""
    from transformers import AutoConfig

    from distconf.tools.drafting import draft_family, read_config_json

    AutoConfig.for_model("deepseek_v32").save_pretrained(tmp_path / "cfg")
    text = draft_family("deepseek_v32", read_config_json(tmp_path / "cfg")).to_yaml(schema_path="x")
    assert "indexed_attention: causal" in text and "  indexer_head_dim: index_head_dim\n" in text, text
    if not with_indexer:
        text = "\n".join(line for line in text.splitlines() if "indexer_head_dim" not in line) + "\n"
    for name, value in (("index_n_heads", 8), ("index_topk", 4)):
        text = "\n".join(f"  {name}: {value}" if line.startswith(f"  {name}:") else line
                         for line in text.splitlines()) + "\n"
    path = tmp_path / "deepseek_v32.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_check_proves_the_indexer_cache(tmp_path: Path, fresh_cache: None) -> None:
    results = check_family(_family(tmp_path))
    assert all(r.ok for r in results), [str(r.failure) for r in results]


def test_an_undeclared_indexer_cache_is_found_by_its_size(tmp_path: Path, fresh_cache: None) -> None:
    (result, *_) = check_family(_family(tmp_path, with_indexer=False))
    assert result.failure is not None and result.failure.field.startswith("kv_cache"), result.failure


def test_a_session_keeps_the_indexer_keys(tmp_path: Path, fresh_cache: None) -> None:
    from blockhelpers import hf_model, save_checkpoint

    from distconf.blocks.kvcache import kv_geometry
    from distconf.blocks.sizing import kv_cache_bytes_per_token
    from distconf.blocks.weights import load_block
    from distconf.loader import load_family
    from distconf.server.compute import ServedBlock
    from distconf.server.session_cache import SessionCache, StepPart, batch_key

    cls = load_family(_family(tmp_path))
    tiny = {k: v for k, v in cls.family_spec.tiny_config.items() if k != "variants"}
    config = cls(**tiny)
    model = hf_model(cls.hf_config_class(**tiny))
    save_checkpoint(model, tmp_path / "ckpt")
    layers = int(config.num_hidden_layers)
    blocks = [load_block(tmp_path / "ckpt", config, i, dtype=torch.float32) for i in range(layers)]
    served = [ServedBlock(f"b.{i}", i, b, torch.float32, kv_geometry(config, i),
                          kv_cache_bytes_per_token(config, torch.float32, i)) for i, b in enumerate(blocks)]
    assert served[0].geometry.indexer_head_dim == config.index_head_dim
    hidden = torch.randn(2, 9, config.hidden_size, generator=torch.Generator().manual_seed(0))

    def whole(h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for block in blocks:
                h, _ = block(h)
        return h

    cache = SessionCache(served, 2, 16)
    cache.allocate()
    out = [cache.step(hidden[:, :4], [None] * layers, None)]
    out += [cache.step(hidden[:, i:i + 1], [None] * layers, None) for i in range(4, 9)]
    torch.testing.assert_close(torch.cat(out, dim=1), whole(hidden), rtol=1e-5, atol=1e-5)
    hypo_ids = torch.tensor([1, 1])
    nxt = torch.randn(2, 1, config.hidden_size)
    step = cache.step(nxt, [None] * layers, hypo_ids)
    torch.testing.assert_close(step, whole(torch.cat([hidden[hypo_ids], nxt], dim=1))[:, 9:], rtol=1e-5, atol=1e-5)
    other = SessionCache(served, 1, 16)
    assert batch_key(StepPart(cache, nxt, [None] * layers)) != batch_key(StepPart(other, nxt[:1], [None] * layers))
    cache.release()


def test_an_indexer_with_a_state_section_is_refused(tmp_path: Path) -> None:
    from blockhelpers import write_family

    from distconf.errors import FamilyValidationError
    from distconf.loader import load_family

    path = write_family(tmp_path, "granitemoehybrid", "indexer_state",
                        lambda t: t.replace("kv_cache:\n", "kv_cache:\n  indexer_head_dim: 4\n"))
    with pytest.raises(FamilyValidationError, match="indexer_head_dim cannot be combined with a state section"):
        load_family(path)
