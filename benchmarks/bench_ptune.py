"""One prompt-tuning training step through a 2-server swarm on loopback against the same step run locally.

The model is a random float32 model of the first built-in family whose tiny config sets
only the plain decoder fields (``--family`` picks another), enlarged to hidden 768, 8
layers, vocabulary 16000 by default: the blocks hold two thirds of the weights, so block
compute dominates a step as it does in real models, and the whole run takes about a
minute and a half on a busy 2-core machine. Its blocks are split over two ``distconf
serve`` processes on 127.0.0.1 (``--dtype fp32``; first half / second half of the
blocks). Every process (this one and each server) runs one torch thread by default
(``--threads``): the servers work one after the other, so each side computes with the
same resources, and single-threaded ops do not stall when the shared machine deschedules
one of their threads.

One training step (``tuning_mode="deep_ptune"``): zero_grad; forward of a fixed batch
B x S of token ids with ``pre_seq_len`` trainable input prompts and per-block deep
prompts; next-token cross-entropy loss; backward (gradients w.r.t. the prompts only: every
weight is frozen, but the input gradient still goes through every block); Adam step.

- swarm: `AutoDistributedModelForCausalLM`; the blocks' forward is ``rpc_forward`` on
  each server, the backward is ``rpc_backward``, which recomputes its blocks' forward
  first (servers keep no activations between calls, as in Petals 2.x);
- local: the same transformers model with the same weights in this process, autograd,
  the same prompts: the input prompts replace the first ``pre_seq_len`` hidden states at
  the first block's input (after the embedding stage, where the swarm client puts them),
  the deep prompts are added to the first ``pre_seq_len`` positions of each block's input
  by forward pre-hooks, and the prompt positions are cut before the LM head. This assumes
  the embedding stage works token by token (positions, if any, applied inside the
  blocks), which holds for the default family; for another family the gradient check
  shows whether it holds.

Both runs start from the same prompts with the same optimizer and are interleaved step
by step, so they share the machine's state; the first step is a warm-up and also checks
that the swarm's prompt gradients equal the local ones. Printed: the median time of the
timed steps split by phase, the ratio swarm/local, the per-step overhead (swarm - local)
with the servers' forward recomputation separated from the rest (transport, serialization,
RPC), and both loss curves. Prints only; no assertions.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

from bench_swarm import make_model, plain_family  # noqa: E402  (benchmarks/ on sys.path above)

PHASES = ("forward", "backward", "optimizer", "total")


@contextlib.contextmanager
def prompted(model: Any, prompts: Any, layers: torch.nn.ModuleList) -> Iterator[None]:
    """Run ``model`` (a local transformers model) with ``prompts`` the way a swarm client does.

    The input is expected to start with ``pre_seq_len`` placeholder tokens: a pre-hook on
    the first block replaces their hidden states by the input prompts; every block's
    pre-hook adds its deep prompts to the first ``pre_seq_len`` positions; a pre-hook on
    the LM head drops the prompt positions.
    """
    pre = prompts.pre_seq_len

    def hidden_arg(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        return args[0] if args else kwargs["hidden_states"]

    def with_hidden(args: tuple[Any, ...], kwargs: dict[str, Any], hidden: torch.Tensor) -> Any:
        return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})

    def block_hook(i: int) -> Callable[..., Any]:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            hidden = hidden_arg(args, kwargs)
            batch = hidden.shape[0]
            head = hidden[:, :pre]
            if i == 0:
                head = prompts.input_prompts(batch, hidden.dtype)
            if prompts.deep:
                head = head + prompts.deep_prompt_embeddings[i].to(hidden.dtype).expand(batch, -1, -1)
            return with_hidden(args, kwargs, torch.cat([head, hidden[:, pre:]], dim=1))
        return hook

    handles = [layer.register_forward_pre_hook(block_hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles.append(model.get_output_embeddings().register_forward_pre_hook(
        lambda module, args: (args[0][:, pre:], *args[1:])))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def layer_list(model: Any, config: Any) -> torch.nn.ModuleList:
    """The decoder-layer list of a local transformers model (``block.prefix`` of distributed ``config``)."""
    from distconf.blocks.weights import layer_prefixes

    modules = dict(model.named_modules())
    for prefix in layer_prefixes(config, 0):
        module = modules.get(prefix[: -len(".0.")])
        if isinstance(module, torch.nn.ModuleList):
            return module
    raise LookupError(f"{type(model).__name__}: no decoder-layer list found")


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over the batch."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def train_step(forward: Callable[[], torch.Tensor], ids: torch.Tensor, optimizer: torch.optim.Optimizer,
               before_step: Callable[[], None] | None = None) -> tuple[float, dict[str, float]]:
    """zero_grad, forward + loss, backward, Adam step; returns the loss and each phase's seconds."""
    t0 = time.perf_counter()
    optimizer.zero_grad()
    loss = lm_loss(forward(), ids)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    if before_step is not None:
        before_step()
    t3 = time.perf_counter()
    optimizer.step()
    t4 = time.perf_counter()
    times = {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t4 - t3}
    times["total"] = sum(times.values())
    return loss.item(), times


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius norms)."""
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def print_header(args: argparse.Namespace, family: str, config: Any, size_mib: float) -> None:
    """What is measured, on what, and how busy the machine is."""
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    n = config.num_hidden_layers
    act_kib = args.batch * (args.seq + args.pre_seq_len) * config.hidden_size * 4 / 1024
    print("Prompt tuning (deep_ptune): one training step through a 2-server swarm on 127.0.0.1 vs the same step "
          "run locally in one process.")
    print("Step = zero_grad, forward, next-token cross-entropy, backward (prompt gradients through every frozen "
          "block), Adam. Servers recompute their blocks' forward inside rpc_backward.")
    print(f"machine: {os.cpu_count()} cores, load average at start (1/5/15 min): {load}; torch threads here "
          f"{torch.get_num_threads()}, per server {os.environ.get('OMP_NUM_THREADS', 'torch default')}")
    print(f"model: {family} family, hidden {config.hidden_size}, intermediate {config.intermediate_size}, {n} layers, "
          f"vocab {config.vocab_size}, {size_mib:,.0f} MiB fp32; servers: blocks 0:{n // 2} and {n // 2}:{n}")
    print(f"batch {args.batch} x seq {args.seq}, pre_seq_len {args.pre_seq_len}, Adam lr {args.lr}, "
          f"{args.steps} timed steps after 1 warm-up step; one activation tensor is {act_kib:,.0f} KiB, "
          f"a step moves 10 of them (forward: 2 hops x in+out; backward: 2 hops x inputs+grad in, grad out)")


def print_results(times: dict[str, dict[str, list[float]]], losses: dict[str, list[float]], recompute_ms: float,
                  grad_errors: tuple[float, float]) -> None:
    """Phase table, ratio, overhead split, gradient check and loss curves."""
    med = {run: {p: 1000 * statistics.median(v[p]) for p in PHASES} for run, v in times.items()}
    swarm, local = med["swarm"], med["local"]
    note = " (bitwise equal)" if grad_errors == (0.0, 0.0) else ""
    print(f"\nprompt gradients, warm-up step, swarm vs local: relative error {grad_errors[0]:.2e} (input prompts), "
          f"{grad_errors[1]:.2e} (deep prompts){note}")
    print(f"\nmedian ms per step over {len(times['swarm']['total'])} steps:")
    print(f"{'':22}" + "".join(f"{p:>11}" for p in PHASES))
    for run in ("swarm", "local"):
        print(f"{run:22}" + "".join(f"{med[run][p]:11.1f}" for p in PHASES))
    print(f"{'swarm - local':22}" + "".join(f"{swarm[p] - local[p]:11.1f}" for p in PHASES))
    overhead = swarm["total"] - local["total"]
    print(f"\nratio swarm/local: {swarm['total'] / local['total']:.2f}x; per-step overhead (swarm - local): "
          f"{overhead:,.1f} ms")
    print(f"  of which the servers' forward recomputation in rpc_backward (~ local no-grad forward of the blocks): "
          f"{recompute_ms:,.1f} ms")
    print(f"  leaving for transport, serialization and RPC (network overhead estimate): {overhead - recompute_ms:,.1f} "
          f"ms per step, {(overhead - recompute_ms) / 4:,.1f} ms per RPC (4 per step)")
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"\nload average at the end (1/5/15 min): {load}")
    print("loss per step (warm-up first; the same start, data and optimizer on both sides):")
    for run in ("swarm", "local"):
        print(f"  {run}: " + " ".join(f"{v:.4f}" for v in losses[run]))


def blocks_forward_seconds(local: Any, prompts: Any, layers: torch.nn.ModuleList, full: torch.Tensor) -> float:
    """Seconds of one no-grad forward through the blocks only (what ``rpc_backward`` recomputes)."""
    stamps: list[float] = []
    first = layers[0].register_forward_pre_hook(lambda m, a: stamps.append(time.perf_counter()))
    last = layers[-1].register_forward_hook(lambda m, a, o: stamps.append(time.perf_counter()))
    try:
        with torch.no_grad(), prompted(local, prompts, layers):
            local(full, use_cache=False)
    finally:
        first.remove()
        last.remove()
    return stamps[-1] - stamps[0]


def run(args: argparse.Namespace, root: Path) -> None:
    """Build the model folder, start the servers, train both ways, print."""
    from client_swarm import start_servers, stop_all

    from distconf.client import AutoDistributedModelForCausalLM
    from distconf.client.ptune import PromptTuning
    from distconf.client.swarm import release_dht
    from distconf.dht import start_local_dht, visible_maddrs

    family = args.family or plain_family()
    overrides = {"hidden_size": args.hidden, "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
                 "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
                 "vocab_size": args.vocab, "max_position_embeddings": 2048}
    model_dir, local = make_model(root / "ptune-model", family, overrides)
    local.requires_grad_(False)
    config = local.config
    n = config.num_hidden_layers
    size = sum(p.numel() * p.element_size() for p in local.parameters()) / 2**20
    print_header(args, family, config, size)
    dht = start_local_dht()
    servers: list[Any] = []
    swarm_model = None
    try:
        servers = start_servers([(model_dir, f"0:{n // 2}"), (model_dir, f"{n // 2}:{n}")], visible_maddrs(dht), root)
        swarm_model = AutoDistributedModelForCausalLM.from_pretrained(
            model_dir, dht=dht, tuning_mode="deep_ptune", pre_seq_len=args.pre_seq_len, max_retries=2,
            request_timeout=60)
        train(args, swarm_model, local, PromptTuning)
    finally:
        if swarm_model is not None:
            swarm_model.shutdown()
        stop_all(servers)
        release_dht(dht)


def train(args: argparse.Namespace, swarm_model: Any, local: Any, prompt_class: type) -> None:
    """Interleaved training steps (swarm, then local), the gradient check, and the printout."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, local.config.vocab_size, (args.batch, args.seq), generator=generator)
    sp = swarm_model.prompts
    with torch.no_grad():  # start with non-zero deep prompts so every block's prompt gradient is exercised
        sp.deep_prompt_embeddings.normal_(0.0, float(sp.prompt_embeddings.std()), generator=generator)
    lp = prompt_class(args.pre_seq_len, local.config.hidden_size, local.config.num_hidden_layers, deep=True)
    lp.load_state_dict(sp.state_dict())
    layers = layer_list(local, swarm_model.config)
    full = torch.cat([torch.zeros(args.batch, args.pre_seq_len, dtype=ids.dtype), ids], dim=1)
    runs = {"swarm": (lambda: swarm_model(ids, use_cache=False).logits, sp),
            "local": (lambda: local(full, use_cache=False).logits, lp)}
    optimizers = {name: torch.optim.Adam(p.parameters(), lr=args.lr) for name, (_, p) in runs.items()}
    grads: dict[str, list[torch.Tensor]] = {}
    times: dict[str, dict[str, list[float]]] = {name: {p: [] for p in PHASES} for name in runs}
    losses: dict[str, list[float]] = {name: [] for name in runs}
    recompute: list[float] = []
    for step in range(args.steps + 1):
        for name, (forward, prompts) in runs.items():
            def keep(prompts: Any = prompts, name: str = name) -> None:
                grads[name] = [prompts.prompt_embeddings.grad.clone(), prompts.deep_prompt_embeddings.grad.clone()]

            with prompted(local, lp, layers) if name == "local" else contextlib.nullcontext():
                loss, phase_times = train_step(forward, ids, optimizers[name], keep if step == 0 else None)
            losses[name].append(loss)
            if step > 0:
                for p in PHASES:
                    times[name][p].append(phase_times[p])
        if step > 0:
            recompute.append(blocks_forward_seconds(local, lp, layers, full))
    errors = (rel_err(grads["swarm"][0], grads["local"][0]), rel_err(grads["swarm"][1], grads["local"][1]))
    print_results(times, losses, 1000 * statistics.median(recompute), errors)


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run the benchmark, print the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--family", default=None, help="family to benchmark; default: the first plain one")
    parser.add_argument("--hidden", type=int, default=768, help="hidden size")
    parser.add_argument("--intermediate", type=int, default=2048, help="MLP size")
    parser.add_argument("--layers", type=int, default=8, help="decoder blocks (split in half over the 2 servers)")
    parser.add_argument("--heads", type=int, default=12, help="attention heads")
    parser.add_argument("--kv-heads", type=int, default=4, help="key/value heads")
    parser.add_argument("--vocab", type=int, default=16000, help="vocabulary size")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--pre-seq-len", type=int, default=16, help="prompt positions")
    parser.add_argument("--lr", type=float, default=0.02, help="Adam learning rate")
    parser.add_argument("--steps", type=int, default=8, help="timed steps (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of this process (local model and client) and of each server; 1 keeps "
                             "the comparison fair and stable on a busy 2-core machine, where multi-threaded ops "
                             "stall whenever one of their threads is descheduled")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)  # inherited by the servers
    with tempfile.TemporaryDirectory(prefix="bench-ptune-") as tmp:
        run(args, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
