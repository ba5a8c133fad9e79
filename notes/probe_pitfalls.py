"""Pitfall experiments for issue 4 (research tool). Run: .venv/bin/python notes/probe_pitfalls.py"""
import sys, tempfile, json, inspect
from pathlib import Path
import torch
from safetensors import safe_open
sys.path.insert(0, str(Path(__file__).parent))
from probe_families import TINY, find_layers, find_rotary, mask_kind, SEQ
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

def cache_kw(layer):
    p = inspect.signature(type(layer).forward).parameters
    return next(k for k in ("cache", "past_key_values", "layer_past") if k in p)

def run(cfg, model, x, masks_override=None, fresh_cfg=None):
    _, layers = find_layers(model, cfg.num_hidden_layers)
    _, rot = find_rotary(model)
    pos = torch.arange(x.shape[1])[None]
    mc = fresh_cfg or cfg
    mk = dict(config=mc, inputs_embeds=x, attention_mask=None, cache=None, position_ids=pos)
    masks = {"full_attention": create_causal_mask(**mk)}
    if getattr(cfg, "sliding_window", None):
        masks["sliding_attention"] = create_sliding_window_causal_mask(**mk)
    if masks_override:
        masks.update(masks_override)
    per_type = "layer_type" in inspect.signature(type(rot).forward).parameters
    for i, layer in enumerate(layers):
        kind = mask_kind(cfg, i)
        pe = rot(x, pos, kind) if per_type else rot(x, pos)
        x = layer(x, attention_mask=masks[kind], position_ids=pos, position_embeddings=pe)
        x = x[0] if isinstance(x, tuple) else x
    return x

res = {}
torch.manual_seed(0)
with torch.no_grad():
    # 1. does the sliding window matter on the tiny config? (replace sliding masks by full causal)
    for mt in ["qwen2", "mistral", "gemma2", "gemma3_text", "phi3", "starcoder2"]:
        cfg = AutoConfig.for_model(mt, **TINY[mt]); torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(cfg).eval()
        x = torch.randn(1, SEQ, cfg.hidden_size)
        a = run(cfg, m, x)
        pos = torch.arange(SEQ)[None]
        full = create_causal_mask(config=cfg, inputs_embeds=x, attention_mask=None, cache=None, position_ids=pos)
        b = run(cfg, m, x, masks_override={"sliding_attention": full})
        # window convention: build a sliding mask of window w and print allowed keys of the last query
        sm = create_sliding_window_causal_mask(config=cfg, inputs_embeds=x, attention_mask=None, cache=None, position_ids=pos)
        if sm.dtype != torch.bool:
            allowed = (sm[0, 0, -1] == 0).nonzero().flatten().tolist()
        else:
            allowed = sm[0, 0, -1].nonzero().flatten().tolist()
        res.setdefault("sliding_matters", {})[mt] = {
            "maxdiff_sliding_vs_full_mask": float((a - b).abs().max()),
            "sliding_window": cfg.sliding_window,
            "keys_visible_to_query_11": allowed,
        }
    # 2. standalone layer with a fresh config: _attn_implementation None -> mask None -> NOT causal
    for mt in ["llama", "qwen3", "gemma2"]:
        kw = TINY.get(mt) or dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2)
        cfg = AutoConfig.for_model(mt, **kw); torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(cfg).eval()
        x = torch.randn(1, SEQ, cfg.hidden_size)
        ref = run(cfg, m, x)
        fresh = AutoConfig.for_model(mt, **kw)
        # rebuild layers standalone from the fresh config, load the same weights
        _, layers = find_layers(m, cfg.num_hidden_layers)
        lcls = type(layers[0])
        alone = [lcls(fresh, i).eval() for i in range(cfg.num_hidden_layers)]
        for a_, l_ in zip(alone, layers):
            a_.load_state_dict(l_.state_dict())
        _, rot = find_rotary(m)
        pos = torch.arange(SEQ)[None]
        def go(c):
            y = x
            mk = dict(config=c, inputs_embeds=y, attention_mask=None, cache=None, position_ids=pos)
            masks = {"full_attention": create_causal_mask(**mk)}
            if getattr(c, "sliding_window", None):
                masks["sliding_attention"] = create_sliding_window_causal_mask(**mk)
            for i, l in enumerate(alone):
                y = l(y, attention_mask=masks[mask_kind(c, i)], position_ids=pos, position_embeddings=rot(y, pos))
                y = y[0] if isinstance(y, tuple) else y
            return y
        bad = go(fresh)
        fresh._attn_implementation = cfg._attn_implementation  # fix: copy the implementation
        good = go(fresh)
        res.setdefault("standalone_fresh_config", {})[mt] = {
            "model_attn_impl": cfg._attn_implementation,
            "maxdiff_with_attn_impl_None": float((bad - ref).abs().max()),
            "maxdiff_after_setting_attn_impl": float((good - ref).abs().max()),
        }
    # 2b. eager vs sdpa on the same weights
    for mt in ["qwen3", "mistral", "deepseek_v2"]:
        cfg = AutoConfig.for_model(mt, **TINY[mt]); torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(cfg).eval()
        x = torch.randn(1, SEQ, cfg.hidden_size)
        a = run(cfg, m, x)
        cfg._attn_implementation = "eager"
        b = run(cfg, m, x)
        res.setdefault("eager_vs_sdpa_maxdiff", {})[mt] = float((a - b).abs().max())
    # 3. lazy DynamicCache() for a single block with layer_idx 2
    cfg = AutoConfig.for_model("qwen3", **TINY["qwen3"]); torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    _, layers = find_layers(m, cfg.num_hidden_layers)
    _, rot = find_rotary(m)
    x = torch.randn(1, 5, cfg.hidden_size); pos = torch.arange(5)[None]
    c = DynamicCache()
    layers[1](x, attention_mask=None, position_ids=pos, position_embeddings=rot(x, pos), cache=c, use_cache=True)
    res["lazy_cache_single_block_idx1"] = {
        "n_cache_layers": len(c.layers),
        "layers": [(type(l).__name__, l.is_initialized) for l in c.layers],
        "get_seq_length(0)": c.get_seq_length(0), "get_seq_length(1)": c.get_seq_length(1),
    }
    # 4. saved checkpoint key format for MoE and fused families
    for mt in ["qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v2", "phi3", "gpt_neox", "mixtral"]:
        kw = TINY.get(mt) or dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                  num_experts_per_tok=2)
        cfg = AutoConfig.for_model(mt, **kw); torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(cfg).eval()
        with tempfile.TemporaryDirectory() as d:
            m.save_pretrained(d)
            files = sorted(p.name for p in Path(d).iterdir())
            with safe_open(str(Path(d) / "model.safetensors"), "pt") as f:
                keys = sorted(f.keys())
            last = cfg.num_hidden_layers - 1
            prefix, _ = find_layers(m, cfg.num_hidden_layers)
            saved = [k for k in keys if k.startswith(f"{prefix}.{last}.")]
            sd = [k for k in m.state_dict() if k.startswith(f"{prefix}.{last}.")]
            m2 = AutoModelForCausalLM.from_pretrained(d)
            same = all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))
        res.setdefault("saved_keys_last_layer", {})[mt] = {
            "files": files, "saved": saved, "state_dict": sd, "saved_equals_state_dict": sorted(saved) == sorted(sd),
            "roundtrip_equal": same,
        }
print(json.dumps(res, indent=1))
Path(__file__).with_name("pitfalls-results.json").write_text(json.dumps(res, indent=1))
