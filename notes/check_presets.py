"""Load every preset written for issue 4, size its blocks on the meta device and measure
the KV cache one block really keeps per token (attention dims kept, MLP/vocab shrunk).
Research tool. Run: .venv/bin/python notes/check_presets.py"""
import json, sys, tempfile, shutil
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

sys.path.insert(0, str(Path(__file__).parent))
from probe_families import find_layers

PRESETS = Path(__file__).resolve().parent.parent / "presets"
MINE = ["Qwen--Qwen2-7B", "Qwen--Qwen3-4B", "mistralai--Mistral-7B-v0.1", "google--gemma-2-9b",
        "Qwen--Qwen3-30B-A3B", "deepseek-ai--DeepSeek-V2-Lite", "microsoft--Phi-3-mini-4k-instruct",
        "ibm-granite--granite-3.3-8b-instruct", "bigcode--starcoder2-7b", "EleutherAI--gpt-neox-20b"]
SHRINK = {  # keep attention geometry, shrink what does not matter for the cache
    "num_hidden_layers": 2, "vocab_size": 128, "intermediate_size": 64, "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16, "num_experts": 4, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "mlp_only_layers": [],
}

def formula(cfg):
    """KV values per token per block, as the family YAML should declare it."""
    if getattr(cfg, "kv_lora_rank", None):
        return 1 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return kv * 2 * hd

out = {}
for name in MINE:
    p = PRESETS / f"{name}.json"
    raw = json.loads(p.read_text())
    cfg = AutoConfig.for_model(**raw)
    cls = CONFIG_MAPPING[raw["model_type"]]
    with tempfile.TemporaryDirectory() as d:
        shutil.copy(p, Path(d) / "config.json")
        cfg2 = cls.from_pretrained(d)
    assert type(cfg2) is type(cfg)
    n = cfg.num_hidden_layers
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    prefix, layers = find_layers(m, n)
    sizes = sorted({sum(q.numel() for q in l.parameters()) for l in layers})
    del m
    small = {**raw, **{k: v for k, v in SHRINK.items() if k in raw or k in ("num_hidden_layers", "vocab_size")}}
    for tok in ("pad_token_id", "bos_token_id", "eos_token_id"):
        small[tok] = None
    if raw["model_type"] == "gpt_neox":
        small["intermediate_size"] = 64
    scfg = AutoConfig.for_model(**small)
    torch.manual_seed(0)
    sm = AutoModelForCausalLM.from_config(scfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 128, (1, 5))
    with torch.no_grad():
        res = sm(ids, use_cache=True)
    cache = res.cache
    per_layer = []
    for cl in cache.layers:
        k, v = cl.keys, cl.values
        toks = k.shape[-2]
        per_layer.append((k[0].numel() + v[0].numel()) // toks)
    measured = per_layer[-1]
    f = formula(cfg)
    groups = cfg.num_attention_heads // (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    out[name] = {
        "model_type": raw["model_type"], "config_class": type(cfg).__name__, "prefix": prefix,
        "layers": n, "block_params": sizes,
        "block_bytes_bf16": [s * 2 for s in sizes],
        "kv_values_per_token_measured": per_layer, "kv_values_formula": f,
        "kv_bytes_per_token_bf16": measured * 2,
        "cache_layer_types": sorted({type(c).__name__ for c in cache.layers}),
        "num_key_value_groups(heads//kv_heads)": groups,
        "head_dim": getattr(cfg, "head_dim", None), "hidden/heads": cfg.hidden_size // cfg.num_attention_heads,
        "sliding_window": getattr(cfg, "sliding_window", None),
        "layer_types": sorted(set(getattr(cfg, "layer_types", None) or [])),
    }
    ok = "OK " if f == measured else "MISMATCH"
    print(f"{ok} {name:40s} kv/token/block bf16={measured*2:6d} B formula={f*2:6d} B  block={[round(s*2/2**20,1) for s in sizes]} MiB")
Path(__file__).with_name("presets-results.json").write_text(json.dumps(out, indent=1, default=str))
