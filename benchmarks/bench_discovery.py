"""Discovery on loopback: 8 peers serving an 80-block model.

Measures (real hivemind DHT on 127.0.0.1, no mocks):

* ``find_block_servers``: all 80 block uids in ONE batched ``get_many`` (median of N runs),
  with distconf's default search beam (5 = hivemind's replica count) and hivemind's (20);
* the same records read with one request per uid (80 ``run_coroutine`` calls), and the ratio;
* announce -> visible: from the start of a server's ``announce_blocks`` until a client's
  ``find_block_servers`` returns the new record (median of several announcements);
* with ``--junk N``: an 8-block model served by two honest peers, read before and after a
  plain hivemind peer (no validator) stores N well-formed junk records per block under
  made-up peer ids; the work per key must stay bounded, not grow with N.

Targets: batched discovery of all 80 blocks under 100 ms median, >= 5x faster than
per-uid requests (on an idle machine).

    .venv/bin/python benchmarks/bench_discovery.py [--repeats 30] [--junk 10000] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from types import SimpleNamespace

from distconf.dht import ServerInfo, ServerState, announce_blocks, find_block_servers, start_local_dht, visible_maddrs
from distconf.dht.discovery import fetch_raw

NUM_BLOCKS = 80
NUM_PEERS = 8
SPAN = 20  # each peer serves 20 blocks; peers start every 10 blocks, so every block has 2 servers


def main() -> int:
    """Run the benchmark and print its figures."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=30, help="batched lookups to time (default 30)")
    p.add_argument("--per-uid-repeats", type=int, default=5, help="per-uid rounds to time (default 5)")
    p.add_argument("--announces", type=int, default=7, help="announce->visible samples (default 7)")
    p.add_argument("--junk", type=int, default=0, help="junk records per block for the flood figure (default 0: skip)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    cfg = SimpleNamespace(dht_prefix="bench-80-block-model", num_hidden_layers=NUM_BLOCKS, update_period=60.0)
    nodes = []
    try:
        t0 = time.perf_counter()
        boot = start_local_dht(num_workers=NUM_BLOCKS)
        nodes.append(boot)
        peers = visible_maddrs(boot)
        servers = [start_local_dht(peers, num_workers=NUM_BLOCKS) for _ in range(NUM_PEERS)]
        nodes += servers
        client = start_local_dht(peers, client_mode=True, num_workers=NUM_BLOCKS)
        nodes.append(client)
        startup = time.perf_counter() - t0
        for i, server in enumerate(servers):
            start = (i * 10) % NUM_BLOCKS
            end = min(start + SPAN, NUM_BLOCKS)
            announce_blocks(server, cfg, start, end, ServerInfo(state=ServerState.ONLINE, throughput=10.0 + i),
                            expiration=600)
        # wraparound: the last peers also cover the first blocks so that every block has two servers
        announce_blocks(servers[-1], cfg, 0, 10, ServerInfo(state=ServerState.ONLINE, throughput=17.0), expiration=600)

        state = find_block_servers(client, cfg)
        served = sum(len(b) for b in state.servers)
        assert not state.uncovered_blocks(), state.uncovered_blocks()

        uids = [f"{cfg.dht_prefix}.{i}" for i in range(NUM_BLOCKS)]
        batched = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            find_block_servers(client, cfg)
            batched.append(time.perf_counter() - t)
        batched_wide = []
        for _ in range(max(5, args.repeats // 3)):
            t = time.perf_counter()
            find_block_servers(client, cfg, beam_size=None)
            batched_wide.append(time.perf_counter() - t)
        per_uid = []
        for _ in range(args.per_uid_repeats):
            t = time.perf_counter()
            for uid in uids:
                fetch_raw(client, [uid])
            per_uid.append(time.perf_counter() - t)

        latencies, announce_calls = [], []
        newcomer = servers[0]
        for k in range(args.announces):
            throughput = 100.0 + k
            t = time.perf_counter()
            announce_blocks(newcomer, cfg, 40, 60, ServerInfo(state=ServerState.ONLINE, throughput=throughput),
                            expiration=600)
            announce_calls.append(time.perf_counter() - t)
            deadline = t + 10.0
            me = newcomer.peer_id.to_base58()
            while time.perf_counter() < deadline:
                seen = find_block_servers(client, cfg).servers[59].get(me)
                if seen is not None and seen.throughput == throughput:
                    latencies.append(time.perf_counter() - t)
                    break
            else:
                latencies.append(float("nan"))
        junk = _junk_figures(peers, servers[:2], client, args.junk) if args.junk > 0 else {}
    finally:
        for node in reversed(nodes):
            node.shutdown()

    med_b, med_u = statistics.median(batched), statistics.median(per_uid)
    result = {
        "peers": NUM_PEERS, "blocks": NUM_BLOCKS, "server_records": served, "dht_startup_s": round(startup, 2),
        "batched_median_ms": round(med_b * 1e3, 2), "batched_p90_ms": round(_p90(batched) * 1e3, 2),
        "batched_hivemind_default_beam_median_ms": round(statistics.median(batched_wide) * 1e3, 2),
        "per_uid_median_ms": round(med_u * 1e3, 2), "speedup": round(med_u / med_b, 1),
        "announce_call_median_ms": round(statistics.median(announce_calls) * 1e3, 2),
        "announce_to_visible_median_ms": round(statistics.median(latencies) * 1e3, 2),
        "announce_to_visible_max_ms": round(max(latencies) * 1e3, 2),
        **junk,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{NUM_PEERS} peers, {NUM_BLOCKS}-block model, {served} server records, loopback "
              f"(DHT startup {startup:.1f} s)")
        print(f"find_block_servers, 1 batched get_many : median {result['batched_median_ms']:8.2f} ms "
              f"(p90 {result['batched_p90_ms']:.2f} ms, n={len(batched)})")
        print(f"  same, hivemind's default beam (20)   : median "
              f"{result['batched_hivemind_default_beam_median_ms']:8.2f} ms (n={len(batched_wide)})")
        print(f"one request per uid (80 requests)      : median {result['per_uid_median_ms']:8.2f} ms "
              f"(n={len(per_uid)})")
        print(f"speedup batched vs per-uid             : {result['speedup']}x")
        print(f"announce_blocks call (20 blocks)       : median {result['announce_call_median_ms']:8.2f} ms")
        print(f"announce -> visible to a client        : median {result['announce_to_visible_median_ms']:8.2f} ms "
              f"(max {result['announce_to_visible_max_ms']:.2f} ms, n={len(latencies)})")
        if junk:
            print(f"8-block model, before {args.junk} junk records/block : median {junk['junk_before_ms']:8.2f} ms")
            print(f"  after (most records seen per block: {junk['junk_records_per_block_seen']}) : median "
                  f"{junk['junk_after_ms']:8.2f} ms (flood stored in {junk['junk_store_s']:.1f} s)")
        ok = med_b < 0.1 and med_u / med_b >= 5
        print(f"targets (<100 ms batched, >=5x): {'met' if ok else 'NOT met'}")
    return 0


async def _flood(_dht, node, prefix: str, num_blocks: int, per_block: int) -> int:
    """Runs in the attacker's DHT process: well-formed records under made-up peer ids."""
    import os

    import base58
    from hivemind.utils import get_dht_time

    keys, subkeys = [], []
    for block in range(num_blocks):
        for _ in range(per_block):
            keys.append(f"{prefix}.{block}")
            subkeys.append(base58.b58encode(bytes([0, 0x24, 8, 1, 0x12, 0x20]) + os.urandom(32)).decode())
    for i in range(0, len(keys), 2000):
        await node.store_many(keys[i:i + 2000], [(2, 1.0, {})] * len(keys[i:i + 2000]), get_dht_time() + 600,
                              subkeys=subkeys[i:i + 2000], num_workers=8)
    return len(keys)


def _junk_figures(peers: list[str], honest: list, client, per_block: int) -> dict[str, float]:
    """Discovery of an 8-block model before and after a flood of junk records."""
    from functools import partial

    from hivemind import DHT

    cfg = SimpleNamespace(dht_prefix="bench-junk-model", num_hidden_layers=8, update_period=60.0)
    for i, server in enumerate(honest):
        announce_blocks(server, cfg, 0, 8, ServerInfo(state=ServerState.ONLINE, throughput=5.0 + i), expiration=600)
    before = _median_ms(lambda: find_block_servers(client, cfg, timeout=120), 10)
    attacker = DHT(initial_peers=peers, start=False, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    attacker.run_in_background(await_ready=True, timeout=60)
    try:
        t = time.perf_counter()
        attacker.run_coroutine(partial(_flood, prefix=cfg.dht_prefix, num_blocks=8, per_block=per_block),
                               return_future=True).result(timeout=900)
        stored = time.perf_counter() - t
        seen = max(len(b) for b in find_block_servers(client, cfg, timeout=120).servers)
        after = _median_ms(lambda: find_block_servers(client, cfg, timeout=120), 5)
    finally:
        attacker.shutdown()
    return {"junk_per_block": per_block, "junk_before_ms": before, "junk_after_ms": after,
            "junk_records_per_block_seen": seen, "junk_store_s": round(stored, 1)}


def _median_ms(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1e3, 2)


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


if __name__ == "__main__":
    sys.exit(main())
