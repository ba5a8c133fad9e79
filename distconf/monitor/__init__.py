"""``distconf monitor``: a live web page of a swarm's health, with a JSON API and Prometheus metrics.

A `Monitor` reads the swarm in a background thread every refresh period with the
discovery functions of `distconf.dht` (so it sees, and skips, exactly what a client
does) and keeps the last good `Snapshot`; `build_app` serves it as a page (``/``), as
versioned JSON (``/api/v1/state``, schema at ``/api/v1/schema``: `SwarmStateV1`) and as
Prometheus gauges (``/metrics``). Requests never wait for the DHT.

>>> dht = start_local_dht(peers, client_mode=True)                    # doctest: +SKIP
>>> app = build_app(Monitor(dht_reader(dht), refresh=10.0))          # doctest: +SKIP
>>> serve_forever(app, "127.0.0.1", 8000)                             # doctest: +SKIP
"""

from __future__ import annotations

from distconf.monitor.app import build_app, state_of
from distconf.monitor.metrics import render_metrics
from distconf.monitor.refresher import DEFAULT_MAX_MODELS, Monitor, Snapshot, dht_reader
from distconf.monitor.serve import RunningServer, serve_forever, start_in_thread
from distconf.monitor.state_schema import SCHEMA_VERSION, ModelStateV1, RouteV1, ServerRowV1, SwarmStateV1

__all__ = [
    "DEFAULT_MAX_MODELS",
    "SCHEMA_VERSION",
    "ModelStateV1",
    "Monitor",
    "RouteV1",
    "RunningServer",
    "ServerRowV1",
    "Snapshot",
    "SwarmStateV1",
    "build_app",
    "dht_reader",
    "render_metrics",
    "serve_forever",
    "start_in_thread",
    "state_of",
]
