"""Research probe for issue 4: how each candidate family's decoder layers behave in the
installed transformers, and whether a generic per-layer driver reproduces the model.

Run:  .venv/bin/python notes/probe_families.py [model_type ...]
Writes notes/probe-results.json and prints a summary.  Research tool, not library code.
"""

from __future__ import annotations

import inspect
import json
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

HERE = Path(__file__).resolve().parent
SEQ = 12  # test sequence length; every tiny sliding window is smaller

# Tiny configs: 2-3 layers, hidden <= 64, vocab <= 256, intermediate <= 128,
# every architecture flag that matters switched on.
TINY: dict[str, dict] = {
    "qwen2": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        use_sliding_window=True, sliding_window=4, max_window_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
    ),
    "qwen3": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        attention_bias=False, tie_word_embeddings=True,
    ),
    "mistral": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        sliding_window=4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "gemma": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
        hidden_act="gelu_pytorch_tanh",
    ),
    "gemma2": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        sliding_window=4, query_pre_attn_scalar=32, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
    ),
    "gemma3_text": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        sliding_window=4, query_pre_attn_scalar=32,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
    ),
    "qwen3_moe": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[0],
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "qwen2_moe": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[0],
        qkv_bias=True,
    ),
    "olmoe": dict(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
        num_experts=4, num_experts_per_tok=2, clip_qkv=None,
    ),
    "deepseek_v2": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
        q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=32, topk_method="greedy", norm_topk_prob=False,
        routed_scaling_factor=1.0,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
            "mscale": 0.707, "mscale_all_dim": 0.707,
        },
    ),
    "deepseek_v3": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=32, n_group=2, topk_group=1,
    ),
    "phi3": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        original_max_position_embeddings=128, sliding_window=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    ),
    "granite": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
        logits_scaling=8.0, attention_bias=False, mlp_bias=False, tie_word_embeddings=True,
    ),
    "starcoder2": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        sliding_window=4, use_bias=True, norm_epsilon=1e-5, bos_token_id=0, eos_token_id=0,
    ),
    "olmo2": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        pad_token_id=1, eos_token_id=2,
    ),
    "gpt_neox": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128, use_parallel_residual=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000, "partial_rotary_factor": 0.25},
        attention_bias=True, bos_token_id=0, eos_token_id=0,
    ),
    "cohere": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        use_qk_norm=True, logit_scale=0.0625, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    ),
    "stablelm": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000, "partial_rotary_factor": 0.25},
        use_qkv_bias=True, qk_layernorm=True, use_parallel_residual=True,
    ),
}


def describe(x):
    """Short description of an argument value."""
    if isinstance(x, torch.Tensor):
        return f"Tensor{tuple(x.shape)}:{str(x.dtype).replace('torch.', '')}"
    if isinstance(x, (tuple, list)):
        return "(" + ", ".join(describe(v) for v in x) + ")"
    if x is None or isinstance(x, (bool, int, float, str)):
        return repr(x)
    return type(x).__name__


def find_layers(model, n_layers):
    """The ModuleList holding the decoder layers: (prefix, list)."""
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == n_layers:
            classes = {type(m).__name__ for m in mod}
            if all(sum(1 for _ in m.parameters()) > 0 for m in mod) and "Attention" not in str(classes):
                return name, mod
    raise RuntimeError("no layer list found")


def find_rotary(model):
    for name, mod in model.named_modules():
        if "Rotary" in type(mod).__name__:
            return name, mod
    return None, None


def mask_kind(cfg, i):
    lt = getattr(cfg, "layer_types", None)
    if lt is not None:
        return lt[i]
    return "sliding_attention" if getattr(cfg, "sliding_window", None) else "full_attention"


def probe(model_type: str) -> dict:
    kw = TINY[model_type]
    cfg = AutoConfig.for_model(model_type, **kw)
    out: dict = {"model_type": model_type, "config_class": f"{type(cfg).__module__}.{type(cfg).__name__}"}
    n = cfg.num_hidden_layers
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    out["causal_lm_class"] = type(meta).__name__
    prefix, layers = find_layers(meta, n)
    out["prefix"] = prefix
    lcls = type(layers[0])
    out["layer_class"] = f"{lcls.__module__}.{lcls.__name__}"
    out["layer_init"] = str(inspect.signature(lcls.__init__))
    fwd = inspect.signature(lcls.forward)
    out["layer_forward"] = str(fwd)
    out["layer_forward_return"] = str(fwd.return_annotation)
    attn = [(nm, m) for nm, m in layers[0].named_modules() if type(m).__name__.endswith("Attention")]
    out["attention"] = [f"{nm} -> {type(m).__module__}.{type(m).__name__}" for nm, m in attn]
    rname, rot = find_rotary(meta)
    out["rotary"] = f"{rname} -> {type(rot).__name__}" if rot is not None else None
    if rot is not None:
        out["rotary_forward"] = str(inspect.signature(type(rot).forward))
    sd = list(meta.state_dict().keys())
    out["layer0_keys"] = [k for k in sd if k.startswith(f"{prefix}.0.")]
    out["non_layer_keys"] = [k for k in sd if not k.startswith(f"{prefix}.")]
    out["params_per_layer"] = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    out["layer_mlp_classes"] = [
        type(getattr(layer, "mlp", None)).__name__ for layer in layers
    ]
    out["attn_implementation"] = meta.config._attn_implementation
    cfg_attrs = {}
    for a in ("head_dim", "num_key_value_heads", "num_attention_heads", "hidden_size",
              "sliding_window", "layer_types", "kv_lora_rank", "qk_rope_head_dim",
              "qk_nope_head_dim", "v_head_dim", "rope_parameters"):
        if hasattr(cfg, a):
            cfg_attrs[a] = getattr(cfg, a)
    out["config_attrs"] = cfg_attrs
    del meta

    # --- real run in float32 ---
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    base_prefix, clayers = find_layers(model, n)
    _, rot = find_rotary(model)
    ids = torch.randint(0, cfg.vocab_size, (2, SEQ))
    captured: list[dict] = []

    def pre_hook(mod, args, kwargs):
        captured.append({"args": args, "kwargs": dict(kwargs)})

    outs: list[torch.Tensor] = []

    def post_hook(mod, args, kwargs, output):
        outs.append(output)

    hs = [layer.register_forward_pre_hook(pre_hook, with_kwargs=True) for layer in clayers]
    hs += [layer.register_forward_hook(post_hook, with_kwargs=True) for layer in clayers]
    with torch.no_grad():
        res = model(ids, use_cache=True)
    for h in hs:
        h.remove()
    cache = getattr(res, "cache", None)
    if cache is None:
        cache = getattr(res, "past_key_values", None)
    out["output_cache_attr"] = "cache" if getattr(res, "cache", None) is not None else "past_key_values"
    out["cache_class"] = type(cache).__name__
    out["cache_layers"] = [
        f"{type(cl).__name__} keys{tuple(cl.keys.shape)} values{tuple(cl.values.shape)}"
        for cl in cache.layers
    ]
    out["layer_output_type"] = describe(outs[0])
    out["model_passes_to_layer"] = {
        "args": [describe(a) for a in captured[0]["args"]],
        "kwargs": {k: describe(v) for k, v in captured[0]["kwargs"].items()},
    }
    out["model_passes_per_layer_masks"] = [describe(c["kwargs"].get("attention_mask")) for c in captured]
    # scaling of the embeddings (outside the blocks)
    h0 = captured[0]["args"][0] if captured[0]["args"] else captured[0]["kwargs"]["hidden_states"]
    emb = model.get_input_embeddings()(ids)
    out["embed_ratio_layer0_input_over_embedding"] = float((h0.norm() / emb.norm()).item())

    # --- generic driver: each layer called with the same knobs, compare with model ---
    params = inspect.signature(lcls.forward).parameters
    cache_kw = next((k for k in ("cache", "past_key_values", "layer_past") if k in params), None)
    out["cache_kwarg"] = cache_kw
    rot_params = inspect.signature(type(rot).forward).parameters if rot is not None else {}
    per_type_rotary = "layer_type" in rot_params

    def run_layers(x, pos, dcache):
        mask_kwargs = dict(config=cfg, inputs_embeds=x, attention_mask=None, cache=dcache, position_ids=pos)
        masks = {
            "full_attention": create_causal_mask(**mask_kwargs),
        }
        if getattr(cfg, "sliding_window", None):
            masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)
        ys = []
        for i, layer in enumerate(clayers):
            kind = mask_kind(cfg, i)
            kwargs = {"attention_mask": masks[kind], "position_ids": pos, "use_cache": True, cache_kw: dcache}
            if rot is not None:
                kwargs["position_embeddings"] = rot(x, pos, kind) if per_type_rotary else rot(x, pos)
            y = layer(x, **kwargs)
            if isinstance(y, tuple):
                y = y[0]
            ys.append(y)
            x = y
        return ys

    with torch.no_grad():
        pos = torch.arange(SEQ)[None]
        d = DynamicCache(config=cfg)
        ys = run_layers(h0, pos, d)
        ref = [o[0] if isinstance(o, tuple) else o for o in outs]
        out["generic_full_maxdiff"] = max(float((a - b).abs().max()) for a, b in zip(ys, ref))
        # incremental: prefix of 5 tokens, then one at a time
        d2 = DynamicCache(config=cfg)
        pieces = [run_layers(h0[:, :5], pos[:, :5], d2)[-1]]
        for t in range(5, SEQ):
            pieces.append(run_layers(h0[:, t : t + 1], pos[:, t : t + 1], d2)[-1])
        inc = torch.cat(pieces, dim=1)
        out["generic_incremental_maxdiff"] = float((inc - ref[-1]).abs().max())
        out["incremental_cache_layers"] = [
            f"{type(cl).__name__} keys{tuple(cl.keys.shape)} values{tuple(cl.values.shape)}"
            for cl in d2.layers
        ]
        # incremental with a plain (non-sliding-aware) DynamicCache: does the mask still match?
        d3 = DynamicCache()
        pieces = [run_layers(h0[:, :5], pos[:, :5], d3)[-1]]
        for t in range(5, SEQ):
            pieces.append(run_layers(h0[:, t : t + 1], pos[:, t : t + 1], d3)[-1])
        inc3 = torch.cat(pieces, dim=1)
        out["generic_incremental_plain_cache_maxdiff"] = float((inc3 - ref[-1]).abs().max())
        # one block alone (last layer) with its own cache, fed the model's input to that layer
        last = n - 1
        x_last = captured[last]["args"][0] if captured[last]["args"] else captured[last]["kwargs"]["hidden_states"]
        d4 = DynamicCache(config=cfg)
        kind = mask_kind(cfg, last)
        mk = dict(config=cfg, inputs_embeds=x_last, attention_mask=None, cache=d4, position_ids=pos)
        m = (create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask)(**mk)
        kwargs = {"attention_mask": m, "position_ids": pos, "use_cache": True, cache_kw: d4}
        if rot is not None:
            kwargs["position_embeddings"] = rot(x_last, pos, kind) if per_type_rotary else rot(x_last, pos)
        y = clayers[last](x_last, **kwargs)
        y = y[0] if isinstance(y, tuple) else y
        out["single_block_maxdiff"] = float((y - ref[last]).abs().max())
        out["single_block_cache_layers_filled"] = [
            (type(cl).__name__, getattr(cl, "is_initialized", None)) for cl in d4.layers
        ]
    return out


def main(argv: list[str]) -> None:
    todo = argv or list(TINY)
    results = {}
    path = HERE / "probe-results.json"
    if path.exists() and argv:
        results = json.loads(path.read_text())
    for mt in todo:
        t0 = time.time()
        try:
            results[mt] = probe(mt)
            results[mt]["probe_seconds"] = round(time.time() - t0, 2)
            r = results[mt]
            print(f"{mt:12s} prefix={r['prefix']:22s} full={r['generic_full_maxdiff']:.2e} "
                  f"inc={r['generic_incremental_maxdiff']:.2e} plain={r['generic_incremental_plain_cache_maxdiff']:.2e} "
                  f"single={r['single_block_maxdiff']:.2e} {r['probe_seconds']}s")
        except Exception as e:  # noqa: BLE001 - research tool
            import traceback

            traceback.print_exc()
            results[mt] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{mt:12s} ERROR {type(e).__name__}: {e}")
    results["_transformers"] = transformers.__version__
    path.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
