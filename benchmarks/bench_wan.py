"""The real model across the network lab: ms per token against the network's floor, a relay's cost, prefills.

Hosts (`distconf.tools.netlab`, root needed): servers ``a`` (blocks 0:15, the swarm's first peer and the
relay) and ``b`` (15:30); ``n`` (15:30) behind a home's NAT, served through ``a``; pairs ``f1``/``f2`` and
``q1``/``q2`` with ``--compression FLOAT16`` and ``BLOCKWISE_8BIT``; the client on ``c``. Each route is
chosen with ``allowed_servers``; one client process serves every measurement (`wan_client.py`).

1. **Decode** (SmolLM2-135M fp32, 32 greedy tokens, median ms between decode steps) at 0, 5, 25 and 50
   ms one-way delay per link, with and without server-to-server push, side by side with the floor of the
   same route: its one-way delays per token (3 with push: client -> a -> b -> client; 4 without) times
   the delay, plus the ms/token measured at 0 ms. The ratio measured / floor is the figure (aim <= 1.15 at
   50 ms).
2. **Relay**: ms per token through the relayed server against the direct one, at 5 and 25 ms.
3. **Prefill** over 20 Mbit/s links (5 ms one-way): seconds to the first token of a 1,024-token prompt,
   hidden states as they are and compressed, and whether the greedy chat answer changes.

Prints the machine's load before and after; no assertions. ``--quick`` runs fewer delays and repeats.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP; servers inherit it

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from line_client import LineClient, load  # noqa: E402  (after the path is set)

TOKENS = 32
PROMPT_TOKENS = 1024
HOPS = {True: 3, False: 4}
"""One-way delays per token: client -> a -> b -> client with push; client -> a -> client -> b -> client without."""
TARGET = 1.15


def decode_ms(client: LineClient, route: list[str], push: bool, repeats: int) -> float:
    gaps: list[float] = []
    for _ in range(repeats):
        gaps += client.ask(op="decode", allowed=route, push=push, tokens=TOKENS)["gaps_ms"]
    return statistics.median(gaps)


def reached(server: Any) -> str:
    """How peers reach a server, from its log's network line ("directly" or "relayed")."""
    for line in server.log_path.read_text().splitlines():
        if "network: listening on" in line:
            return "relayed" if "reached relayed" in line else "directly"
    return "?"


def answer_change(tokens: list[int], reference: list[int]) -> str:
    """"same tokens", or where ``tokens`` first differ from ``reference``."""
    if tokens == reference:
        return "same tokens"
    first = next((i for i, (x, y) in enumerate(zip(tokens, reference)) if x != y), min(len(tokens), len(reference)))
    return f"differs from token {first} of {len(reference)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="delays 0 and 50 only, one repeat each")
    args = parser.parse_args()
    delays = (0, 50) if args.quick else (0, 5, 25, 50)
    repeats = 1 if args.quick else 3

    from lab_swarm import lab_address, ready, start_server

    from distconf.tools.netlab import Lab
    from distconf.tools.serving import stop_all

    print(f"bench_wan: {load()}")
    logs = Path(tempfile.mkdtemp(prefix="bench-wan-"))
    cache = os.environ.get("DISTCONF_CACHE") or str(REPO / ".pytest_cache" / "d" / "distconf-real-model")
    env = {"PYTHONPATH": str(REPO), "DISTCONF_CACHE": cache}
    with Lab() as lab:
        hosts = {name: lab.host(name) for name in ("a", "b", "c", "f1", "f2", "q1", "q2")}
        home = lab.home("home")
        hosts["n"] = lab.host("n", home=home)
        servers = {"a": start_server(hosts["a"], logs, "a", env, "--new-swarm", "--host", hosts["a"].address,
                                     "--blocks", "0:15")}
        boot = lab_address(ready(servers["a"]))
        join = ("--initial-peers", boot)
        servers["b"] = start_server(hosts["b"], logs, "b", env, *join, "--blocks", "15:30")
        for name, compression in (("f", "FLOAT16"), ("q", "BLOCKWISE_8BIT")):
            for i, span in enumerate(("0:15", "15:30"), 1):
                servers[f"{name}{i}"] = start_server(hosts[f"{name}{i}"], logs, f"{name}{i}", env, *join,
                                                     "--blocks", span, "--compression", compression)
        servers["n"] = start_server(hosts["n"], logs, "n", env, *join, "--blocks", "15:30")
        peer = {name: ready(server)["peer_id"] for name, server in servers.items()}
        print("servers reached: " + ", ".join(f"{name} {reached(server)}" for name, server in servers.items()))
        client = LineClient(REPO / "benchmarks" / "wan_client.py", hosts["c"], boot, env)
        try:
            direct = [peer["a"], peer["b"]]
            print(f"\n1. decode, {TOKENS} greedy tokens, median ms/token (route c -> a -> b -> c, SmolLM2-135M fp32)")
            print(f"{'one-way':>8} {'push':>5} {'measured':>9} {'floor':>7} {'ratio':>6}")
            at_zero: dict[bool, float] = {}
            for delay in delays:
                lab.default_link(delay_ms=delay)
                for push in (True, False):
                    ms = decode_ms(client, direct, push, repeats)
                    at_zero.setdefault(push, ms)
                    floor = at_zero[push] + HOPS[push] * delay
                    print(f"{delay:>6} ms {'yes' if push else 'no':>5} {ms:9.1f} {floor:7.1f} {ms / floor:6.2f}"
                          + ("  (target <= 1.15)" if delay == 50 else ""), flush=True)
            print("\n2. a server behind NAT, through its relay (a), vs the direct one (b); push on")
            print(f"{'one-way':>8} {'direct':>7} {'relayed':>8} {'ratio':>6}")
            for delay in (5, 25):
                lab.default_link(delay_ms=delay)
                plain = decode_ms(client, direct, True, repeats)
                relayed = decode_ms(client, [peer["a"], peer["n"]], True, repeats)
                print(f"{delay:>6} ms {plain:7.1f} {relayed:8.1f} {relayed / plain:6.2f}", flush=True)
            print(f"\n3. first token of a {PROMPT_TOKENS}-token prompt over 20 Mbit/s links (5 ms one-way), push on")
            lab.default_link(delay_ms=5, rate_mbit=20)
            routes = {"NONE": direct, "FLOAT16": [peer["f1"], peer["f2"]], "BLOCKWISE_8BIT": [peer["q1"], peer["q2"]]}
            results = {name: client.ask(op="prefill", allowed=route, prompt_tokens=PROMPT_TOKENS)
                       for name, route in routes.items()}
            base = results["NONE"]
            print(f"{'compression':>13} {'first token':>12} {'vs NONE':>8}  greedy chat answer")
            for name, result in results.items():
                seconds = result["first_token_s"]
                print(f"{name:>13} {seconds:10.2f} s {seconds / base['first_token_s']:8.2f}  "
                      f"{answer_change(result['answer'], base['answer'])}")
        finally:
            client.close()
            stop_all(list(servers.values()))
    print(f"\nbench_wan: {load()}; server logs in {logs}")


if __name__ == "__main__":
    main()
