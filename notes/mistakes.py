"""Produce the error each common family-file mistake gives (for docs/adding-a-family.md).
Run: .venv/bin/python notes/mistakes.py"""
import subprocess, sys, re
from pathlib import Path

DRAFTS = Path(__file__).parent / "families-draft"
OUT = Path("/tmp/mist")
CASES = [
    ("wrong_prefix", "qwen3", lambda t: t.replace("prefix: model.layers", "prefix: model.blocks"), "check"),
    ("cache_kw", "gpt_neox", lambda t: t.replace("  call:\n    cache_argument: layer_past\n", ""), "check"),
    ("no_rotary", "qwen3", lambda t: t.replace("  position:\n    rotary_class: transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding\n", ""), "check"),
    ("kv_groups", "qwen3", lambda t: t.replace("kv_groups: num_attention_heads // num_key_value_heads", "kv_groups: 1"), "check"),
    ("head_dim", "qwen3", lambda t: t.replace("kv_groups:", "kv_cache:\n  key_head_dim: hidden_size // num_attention_heads\nkv_groups:"), "check"),
    ("no_window", "mistral", lambda t: re.sub(r"  mask:\n    kind: sliding_window\n    sliding_window: sliding_window[^\n]*\n", "", t), "check"),
    ("sdpa_gemma2", "gemma2", lambda t: t.replace("  attn_implementation: eager     # sdpa cannot softcap; transformers refuses sdpa for Gemma 2\n", ""), "check"),
    ("latent_kv", "deepseek_v2", lambda t: t.replace("kv_cache:\n  num_kv_heads: 1\n  key_head_dim: kv_lora_rank\n  value_head_dim: qk_rope_head_dim\n", ""), "check"),
    ("no_conversion", "qwen3_moe", lambda t: t.replace("  base_model_prefix: model\n", "  base_model_prefix: model\n  checkpoint_conversion: none\n"), "check"),
    ("missing_field", "gpt_neox", lambda t: t.replace("kv_groups: 1", "kv_groups: num_attention_heads // num_key_value_heads"), "check"),
    ("layer_idx", "qwen3", lambda t: t.replace("  base_model_prefix: model\n", "  base_model_prefix: model\n  constructor:\n    layer_idx_argument: null\n"), "check"),
    ("no_tiny", "qwen3", lambda t: t.split("tiny_config:")[0], "check"),
    ("window_too_big", "mistral", lambda t: re.sub(r"  mask:\n    kind: sliding_window\n    sliding_window: sliding_window[^\n]*\n", "", t).replace("  sliding_window: 4\n", "  sliding_window: 64\n"), "check"),
    ("name_mismatch", "qwen3", lambda t: t.replace("family: qwen3", "family: qwen_3"), "validate"),
    ("untrusted", "qwen3", lambda t: t.replace("config_class: transformers.Qwen3Config", "config_class: mypkg.Qwen3Config"), "validate"),
    ("bad_formula", "qwen3", lambda t: t.replace("kv_groups: num_attention_heads // num_key_value_heads", "kv_groups: config.num_attention_heads"), "validate"),
    ("wrong_class", "qwen3", lambda t: t.replace("modeling_qwen3.Qwen3Attention", "modeling_qwen3.Qwen3Atention"), "check"),
]
ONLY = sys.argv[1:]
for name, base, edit, cmd in CASES:
    if ONLY and name not in ONLY:
        continue
    d = OUT / name
    d.mkdir(parents=True, exist_ok=True)
    text = edit((DRAFTS / f"{base}.yaml").read_text())
    fam = re.search(r"^family: (\S+)", text, re.M).group(1)
    path = d / f"{base}.yaml"
    path.write_text(text)
    r = subprocess.run([sys.executable, "-m", "distconf", cmd, str(path)], capture_output=True, text=True)
    lines = [l for l in (r.stdout + r.stderr).splitlines() if "Warning" not in l and "warn(" not in l and l.strip()]
    print(f"===== {name} ({base}, distconf {cmd}) exit={r.returncode}")
    print("\n".join(lines[-8:]))
