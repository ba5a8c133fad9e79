"""Client side of discovery: who serves which block of a model, read in one DHT request.

`find_block_servers` reads the records of all block uids of a model with ONE batched
``DHTNode.get_many`` (run inside the DHT process via ``DHT.run_coroutine``), validates
every entry with `ServerInfo.from_wire`, skips (and logs) entries that do not parse or
whose subkey is not a peer id, and merges the consecutive blocks of each peer into
spans. Everything untrusted stays data: nothing a peer stores is executed or trusted
beyond its schema.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from distconf.dht.records import (
    MODELS_REGISTRY_KEY,
    ModelInfo,
    RecordError,
    ServerInfo,
    ServerState,
)
from distconf.dht.uids import config_block_uids, config_dht_prefix, config_num_blocks

if TYPE_CHECKING:  # pragma: no cover
    from hivemind import DHT
    from hivemind.dht import DHTNode

__all__ = [
    "RemoteSpan",
    "SkippedRecord",
    "DEFAULT_BEAM_SIZE",
    "SwarmState",
    "fetch_raw",
    "find_block_servers",
    "find_models",
    "find_servers_by_prefix",
    "merge_spans",
    "parse_block_records",
]

logger = logging.getLogger(__name__)

DEFAULT_BEAM_SIZE = 5
"""Nodes kept in the search beam when looking for the latest records: hivemind stores
every record on its ``num_replicas`` (5) nearest nodes, so a beam of 5 visits the
replica set; hivemind's own default (``bucket_size``, 20) also visits nodes that can
only hold caches, at about twice the cost on a small swarm. ``None`` = hivemind's default."""


@dataclass(frozen=True)
class RemoteSpan:
    """Consecutive blocks ``start..end-1`` served by one peer, with its record."""

    peer_id: str
    start: int
    end: int
    info: ServerInfo

    @property
    def length(self) -> int:
        """Number of blocks in the span."""
        return self.end - self.start

    @property
    def state(self) -> ServerState:
        """The server's announced state."""
        return self.info.state

    @property
    def throughput(self) -> float:
        """The server's announced throughput (requests/s)."""
        return self.info.throughput


@dataclass(frozen=True)
class SkippedRecord:
    """A DHT entry that was ignored, and why."""

    uid: str
    subkey: str
    reason: str


@dataclass
class SwarmState:
    """What the DHT says about one model.

    ``servers[i]`` maps peer id (base58) to the record it stored for block ``i``;
    ``spans`` are the merged per-peer spans (sorted by start, then peer);
    ``skipped`` lists the entries that did not parse.
    """

    dht_prefix: str
    num_blocks: int
    servers: list[dict[str, ServerInfo]]
    spans: list[RemoteSpan] = field(default_factory=list)
    skipped: list[SkippedRecord] = field(default_factory=list)

    def throughputs(self, min_state: ServerState = ServerState.JOINING) -> list[float]:
        """Per block, the sum of the throughputs of servers at ``min_state`` or better."""
        out = []
        for block in self.servers:
            total = 0.0
            for _, info in sorted(block.items()):  # fixed order: identical float sums everywhere
                if info.state >= min_state:
                    total += info.throughput
            out.append(total)
        return out

    def uncovered_blocks(self, min_state: ServerState = ServerState.JOINING) -> list[int]:
        """Blocks that no server at ``min_state`` or better announces."""
        return [i for i, block in enumerate(self.servers) if not any(s.state >= min_state for s in block.values())]

    @property
    def peers(self) -> list[str]:
        """All peers that announced at least one block (sorted)."""
        return sorted({p for block in self.servers for p in block})


async def _get_many(
    dht: DHT, node: DHTNode, keys: list[str] | None, latest: bool, beam_size: int | None = None,
    prefix: str | None = None, num_blocks: int = 0,
) -> dict[str, Any]:
    """Runs in the DHT process: ONE batched get_many, results flattened to plain data.

    Block uids may be given compactly as ``prefix`` + ``num_blocks``: what travels to the
    DHT process through its pipe stays small (hivemind reads that pipe non-blocking, and
    a message larger than the pipe buffer can be lost).
    """
    if keys is None:
        keys = [f"{prefix}.{i}" for i in range(num_blocks)]
    kwargs: dict[str, Any] = {"num_workers": max(1, len(keys))}
    if beam_size is not None:
        kwargs["beam_size"] = beam_size
    if latest:
        kwargs["sufficient_expiration_time"] = math.inf
    found = await node.get_many(keys, **kwargs)
    out: dict[str, Any] = {}
    for key in keys:
        item = found.get(key)
        if item is None:
            out[key] = None
        elif isinstance(item.value, dict):
            out[key] = ("subkeys", [(sub, v.value, v.expiration_time) for sub, v in item.value.items()])
        else:
            out[key] = ("value", item.value, item.expiration_time)
    return out


def fetch_raw(
    dht: DHT, keys: list[str], *, latest: bool = True, timeout: float | None = 30.0,
    beam_size: int | None = DEFAULT_BEAM_SIZE, _prefix: str | None = None,
) -> dict[str, Any]:
    """Read ``keys`` with one batched request; return plain, unvalidated data per key.

    Each value is ``None`` (not found), ``("subkeys", [(subkey, value, expiration), ...])``
    or ``("value", value, expiration)``.
    """
    keys = list(keys)
    if _prefix is not None and keys == [f"{_prefix}.{i}" for i in range(len(keys))]:
        job = partial(_get_many, keys=None, prefix=_prefix, num_blocks=len(keys), latest=latest, beam_size=beam_size)
    else:
        job = partial(_get_many, keys=keys, latest=latest, beam_size=beam_size)
    future = dht.run_coroutine(job, return_future=True)
    try:
        return future.result(timeout=timeout)
    except BaseException:
        future.cancel()
        raise


def _is_peer_id(subkey: Any) -> bool:
    from hivemind.p2p import PeerID

    if not isinstance(subkey, str) or not 0 < len(subkey) <= 128:
        return False
    try:
        return PeerID.from_base58(subkey).to_base58() == subkey
    except Exception:
        return False


def parse_block_records(
    uids: list[str], raw: dict[str, Any], now: float | None = None
) -> tuple[list[dict[str, ServerInfo]], list[SkippedRecord]]:
    """Validate raw DHT entries of ``uids``: per-block ``{peer: ServerInfo}`` and skipped entries.

    Entries past their expiration (relative to ``now``, DHT time) are dropped silently.
    """
    servers: list[dict[str, ServerInfo]] = []
    skipped: list[SkippedRecord] = []
    for uid in uids:
        block: dict[str, ServerInfo] = {}
        item = raw.get(uid)
        if item is not None:
            if item[0] != "subkeys":
                skipped.append(SkippedRecord(uid, "", f"not a dictionary of server records: {type(item[1]).__name__}"))
            else:
                for subkey, value, expiration in item[1]:
                    if now is not None and expiration is not None and expiration < now:
                        continue
                    if not _is_peer_id(subkey):
                        skipped.append(SkippedRecord(uid, repr(subkey)[:60], "subkey is not a base58 peer id"))
                        continue
                    try:
                        block[subkey] = ServerInfo.from_wire(value)
                    except RecordError as e:
                        skipped.append(SkippedRecord(uid, subkey, str(e)))
        servers.append(block)
    return servers, skipped


def merge_spans(servers: list[dict[str, ServerInfo]]) -> list[RemoteSpan]:
    """Merge each peer's consecutive blocks (with the same state) into spans.

    Only blocks with a record count: a peer's claimed ``start_block``/``end_block`` is not
    trusted beyond what it actually announced. The span carries the record of its first
    block.
    """
    spans: list[RemoteSpan] = []
    open_spans: dict[str, tuple[int, ServerInfo]] = {}
    for index in range(len(servers) + 1):
        block = servers[index] if index < len(servers) else {}
        for peer in list(open_spans):
            start, info = open_spans[peer]
            here = block.get(peer)
            if here is None or here.state != info.state:
                spans.append(RemoteSpan(peer, start, index, info))
                del open_spans[peer]
        for peer, info in block.items():
            if peer not in open_spans:
                open_spans[peer] = (index, info)
    spans.sort(key=lambda s: (s.start, s.end, s.peer_id))
    return spans


def find_servers_by_prefix(
    dht: DHT, dht_prefix: str, num_blocks: int, *, latest: bool = True, timeout: float | None = 30.0,
    beam_size: int | None = DEFAULT_BEAM_SIZE,
) -> SwarmState:
    """Like `find_block_servers`, for a model known only by its prefix and block count."""
    from distconf.dht.records import block_uid

    uids = [block_uid(dht_prefix, i) for i in range(num_blocks)]
    return _find(dht, dht_prefix, uids, latest=latest, timeout=timeout, beam_size=beam_size)


def find_block_servers(
    dht: DHT, config: Any, *, latest: bool = True, timeout: float | None = 30.0,
    beam_size: int | None = DEFAULT_BEAM_SIZE,
) -> SwarmState:
    """Who serves which block of ``config``'s model (all uids in ONE batched request).

    :param dht: a running ``hivemind.DHT`` (client mode is fine).
    :param config: a distributed config (``dht_prefix``, ``num_hidden_layers``).
    :param latest: look for the newest records (asks more peers) rather than any fresh one.
    :param timeout: give up after this many seconds (`TimeoutError`).
    :param beam_size: search beam (see `DEFAULT_BEAM_SIZE`; ``None`` = hivemind's default).
    :returns: a `SwarmState` with per-block servers, merged spans and skipped entries.
    """
    prefix = config_dht_prefix(config)
    config_num_blocks(config)
    return _find(dht, prefix, config_block_uids(config), latest=latest, timeout=timeout, beam_size=beam_size)


def _find(dht: DHT, prefix: str, uids: list[str], *, latest: bool, timeout: float | None,
          beam_size: int | None) -> SwarmState:
    from hivemind.utils import get_dht_time

    raw = fetch_raw(dht, uids, latest=latest, timeout=timeout, beam_size=beam_size, _prefix=prefix)
    servers, skipped = parse_block_records(uids, raw, now=get_dht_time())
    if skipped:
        examples = "; ".join(f"{s.uid}[{s.subkey[:12]}]: {s.reason}" for s in skipped[:3])
        logger.warning("skipped %d unparsable DHT record(s) of %r: %s%s", len(skipped), prefix, examples,
                       " ..." if len(skipped) > 3 else "")
        for s in skipped:
            logger.debug("skipped DHT record %s[%s]: %s", s.uid, s.subkey, s.reason)
    return SwarmState(prefix, len(uids), servers, merge_spans(servers), skipped)


def find_models(dht: DHT, *, latest: bool = True, timeout: float | None = 30.0) -> dict[str, ModelInfo]:
    """Public models listed under ``_petals.models``: ``{dht_prefix: ModelInfo}`` (bad entries skipped)."""
    from hivemind.utils import get_dht_time

    raw = fetch_raw(dht, [MODELS_REGISTRY_KEY], latest=latest, timeout=timeout).get(MODELS_REGISTRY_KEY)
    models: dict[str, ModelInfo] = {}
    if raw is None or raw[0] != "subkeys":
        return models
    now = get_dht_time()
    for subkey, value, expiration in raw[1]:
        if expiration is not None and expiration < now:
            continue
        if not isinstance(subkey, str) or "." in subkey or " " in subkey or not subkey:
            logger.debug("skipped model listing with bad prefix %r", subkey)
            continue
        try:
            models[subkey] = ModelInfo.from_wire(value)
        except RecordError as e:
            logger.debug("skipped model listing %r: %s", subkey, e)
    return models
