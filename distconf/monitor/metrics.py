"""``/metrics``: the snapshot in the Prometheus text exposition format (version 0.0.4).

Written by hand (a dozen gauges do not need a client library). Label values come from the
network (a DHT prefix is any string without whitespace or '.'), so they are escaped as
the format requires (backslash, double quote, newline).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from distconf.monitor.refresher import Monitor

__all__ = ["CONTENT_TYPE", "render_metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""Media type of the Prometheus text format."""

_PREFIX = "distconf_monitor_"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


def _family(name: str, help_text: str, samples: Iterable[tuple[dict[str, str], float]],
            kind: str = "gauge") -> list[str]:
    lines = [f"# HELP {_PREFIX}{name} {help_text}", f"# TYPE {_PREFIX}{name} {kind}"]
    for labels, value in samples:
        text = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
        lines.append(f"{_PREFIX}{name}{{{text}}} {_number(value)}" if text else f"{_PREFIX}{name} {_number(value)}")
    return lines


def render_metrics(monitor: Monitor, now: float | None = None) -> str:
    """The gauges of the monitor's last snapshot, one family per metric."""
    snap = monitor.snapshot
    now = time.time() if now is None else now
    models = list(snap.models.values())
    lines: list[str] = []
    lines += _family("snapshot_age_seconds", "Seconds since the swarm was last read (-1: not read yet).",
                     [({}, -1 if snap.read_at is None else max(0.0, now - snap.read_at))])
    lines += _family("refresh_rounds_total", "Reads of the swarm since the monitor started.",
                     [({}, monitor.rounds)], "counter")
    lines += _family("models", "Models read from the swarm.", [({}, len(models))])
    lines += _family("models_not_read", "Listed models beyond max_models, not read.", [({}, snap.models_not_read)])
    lines += _family("blocks", "Blocks of the model.", [({"model": m.dht_prefix}, m.num_blocks) for m in models])
    lines += _family("blocks_covered", "Blocks with at least one online server.",
                     [({"model": m.dht_prefix}, m.blocks_covered) for m in models])
    lines += _family("servers", "Distinct peers serving the model, by their best state.",
                     [({"model": m.dht_prefix, "state": s}, n) for m in models for s, n in m.peers_by_state.items()])
    lines += _family("route_exists", "1 when a chain of online servers covers every block.",
                     [({"model": m.dht_prefix}, int(m.route.exists)) for m in models])
    lines += _family("route_bottleneck_rps", "Throughput of the slowest hop of the route (requests/s).",
                     [({"model": m.dht_prefix}, m.route.bottleneck_rps) for m in models
                      if m.route.bottleneck_rps is not None])
    lines += _family("skipped_records", "Malformed records ignored in the last read.",
                     [({"model": m.dht_prefix}, m.skipped_records) for m in models])
    lines += _family("failed_blocks", "Blocks whose DHT search failed in the last read.",
                     [({"model": m.dht_prefix}, m.failed_blocks) for m in models])
    lines += _family("caught_by_clients", "Clients claiming their spot checks caught this server computing the "
                     "span wrong (a claim by clients, not a proof; the latest rows per model).",
                     [({"model": m.dht_prefix, "peer": c.peer_id, "blocks": f"{c.start}..{c.end - 1}"}, c.reports)
                      for m in models for c in m.caught])
    lines += _family("caught_servers", "Distinct servers clients claim to have caught (client claims).",
                     [({"model": m.dht_prefix}, len({c.peer_id for c in m.caught})) for m in models])
    lines += _family("skipped_reports", "Malformed client reports ignored in the last read.",
                     [({"model": m.dht_prefix}, m.skipped_reports) for m in models])
    lines += _family("kv_bytes_per_token", "Bytes a K/V-keeping block keeps per token, bfloat16 (known configs).",
                     [({"model": m.dht_prefix}, m.kv_bytes_per_token) for m in models
                      if m.kv_bytes_per_token is not None])
    lines += _family("state_bytes_per_sequence", "Bytes a state-keeping block keeps per sequence, bfloat16 "
                     "(known configs; 0: no block keeps a state).",
                     [({"model": m.dht_prefix}, m.state_bytes_per_sequence) for m in models
                      if m.state_bytes_per_sequence is not None])
    lines += _family("read_error", "1 when the last read of the model failed (older data is served).",
                     [({"model": m.dht_prefix}, int(m.error is not None)) for m in models])
    return "\n".join(lines) + "\n"
