"""Early check of the draft family files in notes/families-draft/ against the generic
adapter as it stands (distconf.blocks.build_block): every block, loaded with the HF
model's weights, must reproduce the HF layer outputs, full sequence and incremental,
and keep the KV geometry the family declares. Research tool, not the real `distconf check`.
Run: .venv/bin/python notes/draft_check.py [family ...]"""
import sys, time
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM
from distconf.loader import load_family
from distconf.blocks import build_block
from distconf.kvcache import kv_geometry

HERE = Path(__file__).parent / "families-draft"
args = sys.argv[1:] or sorted(str(p) for p in HERE.glob("*.yaml"))
paths = [Path(a) if a.endswith(".yaml") else HERE / f"{a}.yaml" for a in args]
for path in paths:
    name = path.stem
    t0 = time.time()
    cls = load_family(path)
    cfg = cls(**cls.family_spec.tiny_config)
    from transformers import AutoConfig
    hf_cfg = AutoConfig.for_model(cls.family_spec.model_type, **cls.family_spec.tiny_config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    cfg._attn_implementation = model.config._attn_implementation
    prefix = cls.family_spec.block.prefix
    layers = model.get_submodule(prefix)
    ins, outs = [], []
    hooks = [l.register_forward_pre_hook(lambda m, a, k: ins.append(a[0] if a else k["hidden_states"]), with_kwargs=True) for l in layers]
    hooks += [l.register_forward_hook(lambda m, a, o: outs.append(o[0] if isinstance(o, tuple) else o)) for l in layers]
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    sd = model.state_dict()
    blocks = []
    for i in range(cfg.num_hidden_layers):
        b = build_block(cfg, i, device="cpu", dtype=torch.float32)
        p = f"{prefix}.{i}."
        missing, unexpected = b.load_state_dict({k[len(p):]: v for k, v in sd.items() if k.startswith(p)}, strict=True), None
        blocks.append(b)
    with torch.no_grad():
        full = max(float((blocks[i](ins[i])[0] - outs[i]).abs().max()) for i in range(len(blocks)))
        x = ins[0]
        caches = [None] * len(blocks)
        pieces = []
        for a, bnd in [(0, 5), (5, 8), (8, 9), (9, 10), (10, 12)]:
            h = x[:, a:bnd]
            for i, b in enumerate(blocks):
                h, caches[i] = b(h, layer_past=caches[i], use_cache=True)
            pieces.append(h)
        inc = float((torch.cat(pieces, 1) - outs[-1]).abs().max())
    g = kv_geometry(cfg)
    k, v = caches[-1]
    held = (k[0].numel() + v[0].numel()) // k.shape[-2]
    ok = full < 1e-4 and inc < 1e-4 and held == g.values_per_token
    print(f"{'OK  ' if ok else 'FAIL'} {name:12s} full={full:.1e} incremental={inc:.1e} "
          f"kv values/token held={held} declared={g.values_per_token} "
          f"(k {tuple(k.shape)} v {tuple(v.shape)}) {time.time()-t0:.2f}s")
