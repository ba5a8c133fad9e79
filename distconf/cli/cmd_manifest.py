"""``distconf manifest``: the sha256 of every block of a model's real weights, for clients to check servers by."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from distconf.blocks.device import DTYPE_CHOICES
from distconf.blocks.quant import QUANT_TYPES
from distconf.cli.helptext import add_command
from distconf.loader.layer_stack import model_layer
from distconf.loader.naming import config_num_blocks

__all__ = ["register", "run", "build_manifest"]

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``manifest`` subcommand."""
    p = add_command(
        subparsers, "manifest", summary="per-block sha256 of a model's weights, for clients to refuse other weights",
        description="Load every block of MODEL (a model folder, a .gguf file or a folder holding one, or a hub id in "
                    "the local Hugging Face cache) exactly as `distconf serve` does (same source, dtype rule and "
                    "quantization, on the CPU), hash each block's weights as servers do, and write a JSON manifest: "
                    "the model's dht_prefix, num_blocks, and for each weights form (a dtype, plus +int8 / +nf4 when "
                    "quantized) the sha256 of every block. Servers announce the same digests in rpc_info; a client "
                    "given the manifest (ClientConfig weights_manifest) refuses servers whose digests differ. A "
                    "digest is what a server says about itself: spot checks (verify_fraction) catch a server that "
                    "lies. The file is written at once when all blocks are hashed (a temporary file renamed: "
                    "never half-written); Ctrl-C leaves no file.",
        examples=[("distconf manifest ./model", "float32 or the checkpoint's dtype (as `serve --dtype auto`)"),
                  ("distconf manifest ./model -o model.manifest.json --dtype fp32 bf16",
                   "two forms in one file"),
                  ("distconf manifest ./SmolLM2-135M-Instruct.Q4_1.gguf --dtype float32 --quant none int8",
                   "a GGUF file; plain and int8 blocks"),
                  ("distconf manifest ./model --adapters support=./support-lora",
                   "with the digests of a LoRA adapter, under the name servers announce it by")],
    )
    p.add_argument("model", metavar="MODEL",
                   help="a model folder (safetensors), a .gguf file or a folder holding one, or a cached hub id")
    p.add_argument("-o", "--output", metavar="FILE", default=None,
                   help="where to write the manifest (default: ./DHT_PREFIX.manifest.json)")
    p.add_argument("--dtype", "--torch-dtype", dest="dtypes", nargs="+", default=["auto"], choices=DTYPE_CHOICES,
                   metavar="D", help="dtypes servers hold the blocks in, one form each (default auto: what "
                                     "`distconf serve --dtype auto` takes on CPU); choices: "
                                     + ", ".join(DTYPE_CHOICES))
    p.add_argument("--quant", "--quant-type", dest="quants", nargs="+", default=["none"], choices=QUANT_TYPES,
                   metavar="Q", help="weight quantizations, combined with each dtype (default none); choices: "
                                     + ", ".join(QUANT_TYPES))
    p.add_argument("--adapters", nargs="+", default=(), metavar="ADAPTER",
                   help="LoRA adapters to list too, as `distconf serve --adapters` takes them (a folder or hub id, "
                        "or NAME=SOURCE): a client using one refuses servers whose adapter digests differ")
    p.add_argument("--dht-prefix", "--dht_prefix", dest="dht_prefix", default=None,
                   help="the model's prefix on the DHT, when servers are started with --dht-prefix")
    p.set_defaults(func=run)


def _forms(config: Any, dtypes: list[str], quants: list[str]) -> dict[str, tuple[Any, str | None]]:
    """Form key -> (torch dtype, quant) for each dtype x quant asked (duplicates once)."""
    import torch

    from distconf.blocks.device import resolve_compute_dtype
    from distconf.blocks.quant import normalize_quant
    from distconf.server.integrity import weights_form

    forms: dict[str, tuple[Any, str | None]] = {}
    for dtype in dtypes:
        name, _ = resolve_compute_dtype(dtype, config, torch.device("cpu"))
        for quant in quants:
            q = normalize_quant(quant)
            forms.setdefault(weights_form(name, q, "cpu"), (getattr(torch, name), q))
    return forms


def build_manifest(source: Any, dtypes: list[str], quants: list[str], adapters: Any = ()) -> Any:
    """The `distconf.client.commitments.WeightsManifest` of an opened model ``source``.

    Blocks are loaded one at a time per form with the server's `distconf.server.loading.load_blocks`
    (so memory holds one block), hashed with `distconf.server.integrity.block_digests`, and
    progress is reported by its `distconf.server.loading.Progress`. ``adapters`` (``--adapters`` arguments) are
    read for every block and listed by the name servers announce (`distconf.blocks.lora.layer_digest`).
    """
    import torch

    from distconf.blocks.sizing import block_size_bytes
    from distconf.client.commitments import WeightsManifest
    from distconf.server.adapters import ServedAdapters, parse_adapters
    from distconf.server.integrity import block_digests
    from distconf.server.loading import Progress, load_blocks

    config = source.config
    n = config_num_blocks(config)
    if source.hub is not None:  # a hub id: every block's shards
        source.hub.fetch_layers(config, [model_layer(config, i) for i in range(n)])
    forms = _forms(config, dtypes, quants)
    total = sum(block_size_bytes(config, dtype, quant, layer_idx=i, device_type="cpu")
                for dtype, quant in forms.values() for i in range(n))
    progress = Progress(n * len(forms), total)
    digests: dict[str, list[str]] = {form: [] for form in forms}
    cpu = torch.device("cpu")
    for i in range(n):
        for form, (dtype, quant) in forms.items():
            (block,) = load_blocks(source.checkpoint_dir, config, i, i + 1, dtype, progress=progress, quant=quant,
                                   device=cpu)
            digests[form].extend(block_digests([block], first_block=i))
            del block
    model = Path(source.name).name if source.kind != "hub" else source.name
    served = ServedAdapters(parse_adapters(adapters), config, torch.float32)
    return WeightsManifest(dht_prefix=str(config.dht_prefix), num_blocks=n,
                           forms={form: tuple(d) for form, d in digests.items()}, model=model,
                           adapters={name: tuple(d) for name, d in served.digests(0, n).items()})


def run(args: argparse.Namespace) -> int:
    """Write the manifest; exit 1 with one line on stderr for a model that cannot be read."""
    from distconf.blocks.safetensors_header import BlockWeightsError
    from distconf.client.commitments import write_manifest
    from distconf.sources import ModelSourceError, open_source

    try:
        source = open_source(args.model, dht_prefix=args.dht_prefix)
        output = Path(args.output or f"{source.config.dht_prefix}.manifest.json")
        if not output.parent.is_dir():
            print(f"distconf manifest: the output folder {output.parent} does not exist", file=sys.stderr)
            return 1
        manifest = build_manifest(source, args.dtypes, args.quants, args.adapters)
    except (ModelSourceError, BlockWeightsError, ValueError) as exc:
        print(f"distconf manifest: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    path = write_manifest(manifest, output)
    forms = ", ".join(manifest.forms)
    listed = f", adapters {', '.join(manifest.adapters)}" if manifest.adapters else ""
    print(f"wrote {path}: {manifest.num_blocks} blocks of {manifest.dht_prefix}, forms {forms}{listed}")
    return 0
