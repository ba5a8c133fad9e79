"""Pitfall: a server hosts only blocks [start, end) and builds masks the way the HF model
does (create_*_mask with its cache). Does the mask come out right during incremental
decoding? Research tool."""
import sys, inspect, json
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).parent))
from probe_families import TINY, find_layers, find_rotary, mask_kind
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

def run_span(cfg, layers, rot, x, pos, cache, start, mask_layer_idx):
    kinds = {mask_kind(cfg, i) for i in range(start, len(layers))}
    masks = {}
    for kind in kinds:
        fn = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
        li = None
        if mask_layer_idx == "first_hosted_of_kind":
            li = next(i for i in range(start, len(layers)) if mask_kind(cfg, i) == kind)
        masks[kind] = fn(config=cfg, inputs_embeds=x, attention_mask=None, cache=cache, position_ids=pos, layer_idx=li)
    p = inspect.signature(type(layers[0]).forward).parameters
    ck = next(k for k in ("cache", "layer_past") if k in p)
    per_type = "layer_type" in inspect.signature(type(rot).forward).parameters
    for i in range(start, len(layers)):
        kind = mask_kind(cfg, i)
        pe = rot(x, pos, kind) if per_type else rot(x, pos)
        x = layers[i](x, attention_mask=masks[kind], position_ids=pos, position_embeddings=pe, use_cache=True, **{ck: cache})
        x = x[0] if isinstance(x, tuple) else x
    return x

res = {}
STEP_SETS = {"one_token_steps": [(t, t + 1) for t in range(5, 12)], "chunks_of_3": [(5, 8), (8, 11), (11, 12)]}
for step_name, STEPS in STEP_SETS.items():
  res[step_name] = {}
  with torch.no_grad():
      for mt in ["qwen3", "mistral", "gemma2", "qwen2", "deepseek_v2"]:
          kw = dict(TINY[mt]); kw["num_hidden_layers"] = 3
          if mt == "gemma2": kw["layer_types"] = None
          cfg = AutoConfig.for_model(mt, **kw); torch.manual_seed(0)
          m = AutoModelForCausalLM.from_config(cfg).eval()
          _, layers = find_layers(m, 3); _, rot = find_rotary(m)
          T = 12
          x0 = torch.randn(1, T, cfg.hidden_size)
          pos = torch.arange(T)[None]
          # reference: full sequence through all blocks, capture input of block 1
          ref_in = {}
          def _grab(mod, a, k):
              ref_in.setdefault("x", a[0] if a else k["hidden_states"])
          h = layers[1].register_forward_pre_hook(_grab, with_kwargs=True)
          ref = run_span(cfg, layers, rot, x0, pos, DynamicCache(config=cfg), 0, None)
          h.remove()
          xin = ref_in["x"]
          out = {}
          for mode in (None, "first_hosted_of_kind"):
              for cache_kind in ("config", "plain"):
                  c = DynamicCache(config=cfg) if cache_kind == "config" else DynamicCache()
                  key = f"mask_layer_idx={mode or 'default'},cache={cache_kind}"
                  try:
                      pieces = [run_span(cfg, layers, rot, xin[:, :5], pos[:, :5], c, 1, mode)]
                      for a, b in STEPS:
                          pieces.append(run_span(cfg, layers, rot, xin[:, a:b], pos[:, a:b], c, 1, mode))
                      inc = torch.cat(pieces, 1)
                      out[key] = float((inc - ref).abs().max())
                  except RuntimeError as exc:
                      out[key] = f"error: {str(exc)[:80]}"
          res[step_name][mt] = out
          print(step_name, mt, json.dumps(out))
Path(__file__).with_name("partial-span-results.json").write_text(json.dumps(res, indent=1))
