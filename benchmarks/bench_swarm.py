"""Generation through a 2-server swarm on loopback against the same model run locally.

For a tiny model (the family's ``tiny_config``) and a larger one (hidden size 1024, 8
layers, the same family), with the blocks split over two ``distconf serve`` processes on
127.0.0.1 (float32), prints side by side:

- time per generated token (median over the decode steps, batch 1) through the swarm,
  with and without server-to-server push, and locally in one process, as a ratio;
- the per-hop overhead: (swarm time - local time) / 2 servers, in ms;
- tokens per second with and without push;
- each server's peak RSS against its blocks' bytes plus its cache budget.

The family is the first built-in one whose tiny config sets only the plain decoder fields
(vocabulary, hidden and MLP sizes, layers, attention and KV heads, positions); ``--family``
picks another. Prints only; no assertions.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from decode_timing import step_gaps

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

PLAIN = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "max_position_embeddings"}


def plain_family() -> str:
    """The first family (sorted) whose tiny config uses only plain decoder fields."""
    from distconf.loader import list_families, load_family

    for name in sorted(list_families()):
        tiny = load_family(name).family_spec.tiny_config
        if tiny and set(tiny) <= PLAIN:
            return name
    raise LookupError("no family with a plain tiny config")


def make_model(directory: Path, family: str, overrides: dict[str, Any]) -> tuple[Path, Any]:
    """A random model of ``family`` with ``overrides`` on its tiny config, saved with a distributed config."""
    from transformers import AutoModelForCausalLM

    from distconf.loader import load_family
    from distconf.loader.auto import AutoDistributedConfig
    from distconf.tools.checker import tiny_variants

    cls = load_family(family)
    _, values = tiny_variants(dict(cls.family_spec.tiny_config))[0]
    config = cls.hf_config_class(**{**values, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    AutoDistributedConfig.from_pretrained(str(directory), dht_prefix=f"bench-{directory.name}").save_pretrained(
        directory)
    return directory, model


def per_token_ms(models: dict[str, Any], ids: torch.Tensor, new_tokens: int, repeats: int) -> dict[str, float]:
    """Median ms per decode step of each model; runs are interleaved so all share the machine's state."""
    gaps: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            gaps[name] += step_gaps(model, ids, new_tokens)
    return {name: 1000 * statistics.median(g) for name, g in gaps.items()}


def peak_rss_mib(pid: int) -> float:
    """Peak resident memory (VmHWM) of a process and its children, in MiB."""
    total = 0.0
    pids = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(c) for c in children]
    except OSError:
        pass
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return total


def server_budget_mib(log: Path) -> tuple[float, float]:
    """(blocks MiB, cache budget MiB) from a server's log."""
    text = log.read_text()
    cache = re.search(r"cache budget ([\d.,]+) MiB", text)
    blocks = re.findall(r"loading blocks: \d+/\d+, [\d.,]+/([\d.,]+) MiB", text)
    return (float(blocks[-1].replace(",", "")) if blocks else float("nan"),
            float(cache.group(1).replace(",", "")) if cache else float("nan"))


def bench(name: str, family: str, overrides: dict[str, Any], root: Path, new_tokens: int, repeats: int) -> None:
    from client_swarm import start_servers, stop_all

    from distconf.client import AutoDistributedModelForCausalLM
    from distconf.client.swarm import release_dht
    from distconf.dht import start_local_dht, visible_maddrs

    model_dir, local = make_model(root / name, family, overrides)
    n = local.config.num_hidden_layers
    dht = start_local_dht()
    servers = start_servers([(model_dir, f"0:{n // 2}"), (model_dir, f"{n // 2}:{n}")], visible_maddrs(dht), root)
    try:
        ids = torch.randint(0, local.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
        with_push = AutoDistributedModelForCausalLM.from_pretrained(model_dir, dht=dht, use_server_to_server=True,
                                                                    max_retries=2)
        no_push = AutoDistributedModelForCausalLM.from_pretrained(model_dir, dht=dht, use_server_to_server=False,
                                                                  max_retries=2)
        models = {"local": local, "push": with_push, "plain": no_push}
        per_token_ms(models, ids, 4, 1)  # warm up every path and the servers
        times = per_token_ms(models, ids, new_tokens, repeats)
        local_ms, push_ms, plain_ms = times["local"], times["push"], times["plain"]
        size = sum(p.numel() * p.element_size() for p in local.parameters()) / 2**20
        print(f"\n== {name}: {family} family, hidden {local.config.hidden_size}, {n} layers, {size:,.0f} MiB fp32, "
              f"2 servers on loopback, batch 1, {new_tokens} new tokens x {repeats}, "
              f"{torch.get_num_threads()} thread(s) here")
        print(f"{'':24}{'ms/token':>10}{'tokens/s':>10}{'vs local':>10}{'ms/hop':>10}")
        for label, ms in (("local (one process)", local_ms), ("swarm, no push", plain_ms),
                          ("swarm, push", push_ms)):
            hop = "" if label.startswith("local") else f"{(ms - local_ms) / 2:10.2f}"
            print(f"{label:24}{ms:10.2f}{1000 / ms:10.1f}{ms / local_ms:9.2f}x{hop}")
        for i, s in enumerate(servers):
            blocks, cache = server_budget_mib(s.log_path)
            rss = peak_rss_mib(s.proc.pid)
            print(f"server {i}: peak RSS {rss:,.0f} MiB (process and its DHT child) vs blocks {blocks:,.1f} MiB + "
                  f"cache budget {cache:,.1f} MiB = {blocks + cache:,.1f} MiB")
        with_push.shutdown()
        no_push.shutdown()
    finally:
        stop_all(servers)
        release_dht(dht)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default=None, help="family to benchmark (default: the first plain one)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-large", action="store_true", help="only the tiny model")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of this process, which runs the local model and the client (default 1: "
                             "on a busy 2-core machine more threads make tiny models slower)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    family = args.family or plain_family()
    large = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
             "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 2048}
    with tempfile.TemporaryDirectory(prefix="bench-swarm-") as tmp:
        bench("tiny", family, {"num_hidden_layers": 4}, Path(tmp), args.new_tokens, args.repeats)
        if not args.skip_large:
            bench("hidden1024", family, large, Path(tmp), args.new_tokens, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
