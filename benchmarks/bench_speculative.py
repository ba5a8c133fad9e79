"""Speculative decoding through the swarm: tokens/s plain vs with a draft, across the network lab's delays.

The real model (SmolLM2-135M-Instruct fp32) on two servers on lab hosts (blocks 0:15 and 15:30, `distconf.tools
.netlab`: root needed), the client on a third; up to 64 greedy tokens for each of four fixed chat prompts
(`speculative_client.PROMPTS`), through `distconf.client.textgen.stream_text`:

- **plain**: one token per step;
- **draft**: the same GGUF's weights, layers int8, on the client, as the draft model;
- **lookup**: prompt lookup (n-gram matches in the context, no model);
- **wrong**: a draft that is always wrong (the int8 draft's tokens shifted by one): what a bad draft costs
  once speculation turns itself off.

On loopback (servers and client as plain processes on 127.0.0.1, no lab), then at 0 ms (the lab's links without
delay), 25 and 50 ms one-way delay per link. Prints tokens/s, the ratio to
plain, the mean proposals kept per speculative round, and whether the tokens equal plain greedy's (they must).
Aim: draft >= 2x plain at 25 ms; wrong no more than 10 % slower than plain. Prints the machine's load.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from line_client import LineClient, load  # noqa: E402  (after the path is set)

SOURCES = ("none", "draft", "lookup", "wrong")
TOKENS = 64


def print_rows(client: LineClient, label: str) -> None:
    """Every source's row at one network setting."""
    results = {source: client.ask(source=source, tokens=TOKENS) for source in SOURCES}
    plain = results["none"]
    plain_rate = sum(map(len, plain["tokens"])) / plain["seconds"]
    for source, result in results.items():
        rate = sum(map(len, result["tokens"])) / result["seconds"]
        kept = result["kept"] / result["rounds"] if result["rounds"] else 0.0
        same = "same as plain" if result["tokens"] == plain["tokens"] else "DIFFER from plain"
        print(f"{label:>9} {source:>7} {rate:9.2f} {rate / plain_rate:8.2f}x {kept:11.2f}  "
              f"{same} ({result['rounds']} rounds; step ms by width {result['steps']}, "
              f"draft {result['draft_ms']} ms/token)", flush=True)


def loopback(logs: Path, env: dict[str, str]) -> None:
    """The loopback rows: two servers and the client as plain processes on 127.0.0.1."""
    from lab_swarm import lab_address, ready

    from distconf.tools import real_model as rm
    from distconf.tools.serving import ServerProcess, serve_command, stop_all

    def serve(name: str, *args: str) -> ServerProcess:
        command = serve_command(rm.gguf_path(), "--dtype", "float32", "--host", "127.0.0.1", *args)
        return ServerProcess(command, logs / f"{name}.log", name=name, env=env)

    servers = [serve("loopback-a", "--new-swarm", "--blocks", "0:15")]
    try:
        boot = lab_address(ready(servers[0]))
        servers.append(serve("loopback-b", "--initial-peers", boot, "--blocks", "15:30"))
        ready(servers[1])
        client = LineClient(REPO / "benchmarks" / "speculative_client.py", None, boot, env)
        try:
            print_rows(client, "loopback")
        finally:
            client.close()
    finally:
        stop_all(servers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delays", type=int, nargs="*", default=[0, 25, 50], metavar="MS",
                        help="one-way delays per link in the network lab (none: no lab rows)")
    parser.add_argument("--no-loopback", action="store_true", help="skip the loopback rows")
    args = parser.parse_args()

    from lab_swarm import lab_address, ready, start_server

    from distconf.tools.netlab import Lab
    from distconf.tools.serving import stop_all

    print(f"bench_speculative: {load()}")
    logs = Path(tempfile.mkdtemp(prefix="bench-spec-"))
    cache = os.environ.get("DISTCONF_CACHE") or str(REPO / ".pytest_cache" / "d" / "distconf-real-model")
    env = {"PYTHONPATH": str(REPO), "DISTCONF_CACHE": cache}
    print(f"\n{TOKENS} greedy tokens per prompt, 4 chat prompts; servers with blocks 0:15 and 15:30, the client apart")
    print(f"{'network':>9} {'source':>7} {'tokens/s':>9} {'vs plain':>9} {'kept/round':>11}  tokens")
    if not args.no_loopback:
        loopback(logs, env)
    if not args.delays:
        print(f"\nbench_speculative: {load()}; server logs in {logs}")
        return
    with Lab() as lab:
        a, b, c = lab.host("a"), lab.host("b"), lab.host("c")
        servers = [start_server(a, logs, "a", env, "--new-swarm", "--host", a.address, "--blocks", "0:15")]
        boot = lab_address(ready(servers[0]))
        servers.append(start_server(b, logs, "b", env, "--initial-peers", boot, "--blocks", "15:30"))
        ready(servers[1])
        client = LineClient(REPO / "benchmarks" / "speculative_client.py", c, boot, env)
        try:
            for delay in args.delays:
                lab.default_link(delay_ms=delay)
                print_rows(client, f"lab {delay} ms")
        finally:
            client.close()
            stop_all(servers)
    print(f"\nbench_speculative: {load()}; server logs in {logs}")


if __name__ == "__main__":
    main()
