"""The swarm monitor on loopback: 8 peers serving an 80-block model.

Measures (real hivemind DHT on 127.0.0.1, real uvicorn server, no mocks):

* raw discovery: what the monitor reads per refresh with discovery's own functions
  (``read_model_listing`` + ``find_servers_by_prefix`` of the model), median of N runs;
* a monitor refresh: the same reads plus building the state (spans, coverage, route),
  median of N runs, and its ratio to raw discovery;
* render: building the state from the discovery result and serializing ``/api/v1/state``
  (no DHT: pure CPU), median of N runs, and its ratio to raw discovery;
* ``GET /api/v1/state`` over HTTP (median), and the size in bytes of the page (HTML, script,
  style, icon) and of the JSON and metrics of this swarm.

    .venv/bin/python benchmarks/bench_monitor.py [--repeats 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from types import SimpleNamespace

from distconf.dht import (
    ServerInfo,
    ServerState,
    announce_blocks,
    find_servers_by_prefix,
    read_model_listing,
    start_local_dht,
    visible_maddrs,
)
from distconf.monitor import Monitor, Snapshot, build_app, dht_reader, start_in_thread, state_of
from distconf.monitor.app import STATIC_FILES
from distconf.monitor.snapshot import model_state

NUM_BLOCKS = 80
NUM_PEERS = 8
SPAN = 20  # each peer serves 20 blocks; peers start every 10 blocks, so every block has 2 servers
PREFIX = "bench-monitor-80-block-model"


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read()


def _start_swarm(nodes: list) -> object:
    cfg = SimpleNamespace(dht_prefix=PREFIX, num_hidden_layers=NUM_BLOCKS, update_period=60.0)
    boot = start_local_dht(num_workers=NUM_BLOCKS)
    nodes.append(boot)
    peers = visible_maddrs(boot)
    servers = [start_local_dht(peers, num_workers=NUM_BLOCKS) for _ in range(NUM_PEERS)]
    nodes += servers
    client = start_local_dht(peers, client_mode=True, num_workers=NUM_BLOCKS)
    nodes.append(client)
    for i, server in enumerate(servers):
        start = (i * 10) % NUM_BLOCKS
        info = ServerInfo(state=ServerState.ONLINE, throughput=10.0 + i, public_name=f"peer-{i}",
                          cache_tokens_left=65536, torch_dtype="bfloat16", version="2.3.0")
        for a, b in ((start, min(start + SPAN, NUM_BLOCKS)), (0, start + SPAN - NUM_BLOCKS)):
            if b > a:
                announce_blocks(server, cfg, a, b, info, expiration=600)
    return client


def main() -> int:
    """Run the benchmark and print its figures."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=20, help="samples per timed figure (default 20)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    nodes: list = []
    running = None
    try:
        client = _start_swarm(nodes)

        def discover():
            listing, _ = read_model_listing(client)
            return find_servers_by_prefix(client, PREFIX, listing[PREFIX].num_blocks)

        state = discover()
        assert len(state.peers) == NUM_PEERS and not state.uncovered_blocks(), "the swarm is not fully visible"
        reader = dht_reader(client)
        monitor = Monitor(reader, refresh=3600.0)  # never refreshes by itself: reads below are timed
        monitor.snapshot = reader(Snapshot())

        def render():
            monitor.snapshot = Snapshot({PREFIX: model_state(state)}, time.time())
            return state_of(monitor).model_dump_json()

        discovery_s = _median(discover, args.repeats)
        refresh_s = _median(lambda: reader(Snapshot()), args.repeats)
        render_s = _median(render, args.repeats)
        running = start_in_thread(build_app(monitor, manage=False))
        http_s = _median(lambda: _get(running.url + "/api/v1/state"), args.repeats)
        page = {"index.html": len(_get(running.url + "/"))}
        page.update({name: len(_get(f"{running.url}/static/{name}")) for name in STATIC_FILES})
        figures = {
            "peers": NUM_PEERS, "blocks": NUM_BLOCKS,
            "raw_discovery_ms": round(discovery_s * 1000, 2),
            "monitor_refresh_ms": round(refresh_s * 1000, 2),
            "refresh_over_discovery": round(refresh_s / discovery_s, 3),
            "render_ms": round(render_s * 1000, 3),
            "render_over_discovery": round(render_s / discovery_s, 4),
            "http_state_ms": round(http_s * 1000, 2),
            "page_bytes": sum(page.values()), "page_files_bytes": page,
            "state_json_bytes": len(_get(running.url + "/api/v1/state")),
            "metrics_bytes": len(_get(running.url + "/metrics")),
        }
    finally:
        if running is not None:
            running.stop()
        for node in reversed(nodes):
            node.shutdown()
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        print(f"swarm monitor, {NUM_PEERS} peers, {NUM_BLOCKS}-block model (medians of {args.repeats})")
        print(f"  raw discovery (listing + blocks):   {figures['raw_discovery_ms']:9.2f} ms")
        print(f"  monitor refresh (reads + state):    {figures['monitor_refresh_ms']:9.2f} ms  "
              f"({figures['refresh_over_discovery']:.2f}x discovery)")
        print(f"  render state + JSON (no DHT):       {figures['render_ms']:9.3f} ms  "
              f"({figures['render_over_discovery']:.3f}x discovery)")
        print(f"  GET /api/v1/state over HTTP:        {figures['http_state_ms']:9.2f} ms")
        print(f"  page size (html+js+css+icon):       {figures['page_bytes']:9d} bytes  {page}")
        print(f"  /api/v1/state JSON of this swarm:   {figures['state_json_bytes']:9d} bytes")
        print(f"  /metrics of this swarm:             {figures['metrics_bytes']:9d} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
