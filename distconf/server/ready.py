"""The ready line a ``distconf serve`` process prints to stdout once it is ONLINE: what tools that start servers
(the demo, the tests, the benchmarks) wait for and read."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["READY_TAG", "parse_ready_line", "ready_line", "ready_record"]

READY_TAG = "DISTCONF_READY"
"""First word of the machine-readable line a server prints to stdout once it is ONLINE (a JSON object follows)."""


def ready_record(server: Any) -> dict[str, Any]:
    """What the ready line says about an ONLINE `BlockServer`: peer id, addresses, blocks, prefix, throughput,
    parameters, dtype, quant_type (the record's value) and device."""
    from distconf.blocks.quant import petals_quant_type

    blocks = server.handler.ordered if server.handler is not None else []
    return {"peer_id": str(server.peer_id), "addresses": list(server.maddrs),
            "blocks": [int(server.start_block), int(server.end_block)], "dht_prefix": str(server.config.dht_prefix),
            "throughput": float(server.throughput),
            "parameters": sum(p.numel() for block in blocks for p in block.module.parameters()),
            "dtype": str(server.dtype_name), "quant_type": petals_quant_type(server.quant),
            "device": str(server.device)}


def ready_line(server: Any) -> str:
    """``DISTCONF_READY {"peer_id": ..., "addresses": [...], "blocks": [start, end], ...}`` (one line)."""
    return f"{READY_TAG} {json.dumps(ready_record(server), sort_keys=True)}"


def parse_ready_line(line: str) -> dict[str, Any] | None:
    """The record of a ready line, or None if ``line`` is another line."""
    tag, _, payload = line.strip().partition(" ")
    if tag != READY_TAG:
        return None
    record = json.loads(payload)
    if not isinstance(record, dict) or not {"peer_id", "addresses", "blocks", "dht_prefix"} <= set(record):
        raise ValueError(f"malformed {READY_TAG} line: {line.strip()!r}")
    return record
