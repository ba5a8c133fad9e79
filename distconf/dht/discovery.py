"""Client side of discovery: who serves which block of a model, read in one DHT request.

`find_block_servers` reads the records of all block uids of a model with ONE batched
search (run inside the DHT process via ``DHT.run_coroutine``), validates every record
with `ServerInfo.from_wire`, skips (and logs) records that do not parse or whose subkey
is not a well-formed libp2p peer id, and merges the consecutive blocks of each peer into
spans. Everything untrusted stays data: nothing a peer stores is executed or trusted
beyond its schema.

Failures are isolated per key and per record: the node is guarded first
(`distconf.dht.guard`: a bad record is dropped on arrival, alone), each key's search
completes on its own (a key whose search fails or does not finish in time is reported
in `SwarmState.failed` while the other keys are returned), and at most
``max_records_per_key`` records per key are parsed.

Server records are data any peer can write (in Petals-compatible mode even under another
peer's subkey): `distconf.dht.liveness` lets a client confirm that a server answers
before trusting its record.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distconf.dht.fetch import DEFAULT_BEAM_SIZE, _fetch, fetch_raw
from distconf.dht.peerids import owner_matches_peer, peer_id_problem, split_subkey
from distconf.dht.records import (
    MAX_NUM_BLOCKS,
    MODELS_REGISTRY_KEY,
    ModelInfo,
    RecordError,
    ServerInfo,
    ServerState,
    listing_prefix_problem,
)
from distconf.loader.config_protocol import DistributedConfig
from distconf.loader.naming import block_uids, config_block_uids, config_dht_prefix

if TYPE_CHECKING:  # pragma: no cover
    from hivemind import DHT

__all__ = [
    "DEFAULT_BEAM_SIZE",
    "RemoteSpan",
    "SkippedRecord",
    "SwarmState",
    "fetch_raw",
    "find_block_servers",
    "find_models",
    "find_servers_by_prefix",
    "merge_spans",
    "parse_block_records",
    "read_model_listing",
]

logger = logging.getLogger(__name__)

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
    ``skipped`` lists the entries that did not parse; ``failed`` maps block uids whose
    search failed (or did not finish in time) to the reason; ``signed`` says whether
    only signed records were accepted.
    """

    dht_prefix: str
    num_blocks: int
    servers: list[dict[str, ServerInfo]]
    spans: list[RemoteSpan] = field(default_factory=list)
    skipped: list[SkippedRecord] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    signed: bool = False

    def throughputs(self, min_state: ServerState = ServerState.JOINING) -> list[float]:
        """Per block, the sum of the throughputs of servers at ``min_state`` or better.

        JOINING counts by default: this is the view a server uses to place itself (as
        Petals 2.x servers do); clients route through ONLINE servers only.
        """
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


# --------------------------------------------------------------------------- parsing
def _record_peer(subkey: Any, signed: bool) -> str:
    """The peer id of a server-record subkey; `ValueError` if it is not acceptable."""
    peer, owner = split_subkey(subkey)
    problem = peer_id_problem(peer)
    if problem is not None:
        raise ValueError(f"subkey {peer!r:.60} is not a libp2p peer id: {problem}")
    if signed:
        if owner is None:
            raise ValueError("unsigned record (only signed records are accepted)")
        if not owner_matches_peer(peer, owner):
            raise ValueError("the owner key of the record is not the key of its peer id")
    elif owner is not None:
        raise ValueError("signed record (this client runs in Petals-compatible mode)")
    return peer


def parse_block_records(
    uids: list[str], raw: dict[str, Any], now: float | None = None, *, signed: bool = False,
    max_records: int | None = None,
) -> tuple[list[dict[str, ServerInfo]], list[SkippedRecord]]:
    """Validate raw DHT entries of ``uids``: per-block ``{peer: ServerInfo}`` and skipped entries.

    Entries past their expiration (relative to ``now``, DHT time) are dropped silently.
    With ``signed``, only records whose subkey carries the owner key of their peer id are
    kept. At most ``max_records`` records per block are examined.
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
                records = item[1] if max_records is None else item[1][:max_records]
                for subkey, value, expiration in records:
                    if now is not None and expiration is not None and expiration < now:
                        continue
                    try:
                        peer = _record_peer(subkey, signed)
                        if peer in block:
                            raise ValueError("a second record for the same peer")
                        block[peer] = ServerInfo.from_wire(value)
                    except (RecordError, ValueError) as e:
                        skipped.append(SkippedRecord(uid, repr(subkey)[:60] if not isinstance(subkey, str)
                                                     else subkey[:60], str(e)[:300]))
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


# --------------------------------------------------------------------------- finding
def find_servers_by_prefix(
    dht: DHT, dht_prefix: str, num_blocks: int, *, latest: bool = True, timeout: float | None = 30.0,
    beam_size: int | None = DEFAULT_BEAM_SIZE, max_records_per_block: int | None = None,
) -> SwarmState:
    """Like `find_block_servers`, for a model known only by its prefix and block count."""
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or not 1 <= num_blocks <= MAX_NUM_BLOCKS:
        raise ValueError(f"num_blocks must be an integer in 1..{MAX_NUM_BLOCKS}, got {num_blocks!r}")
    uids = block_uids(dht_prefix, 0, num_blocks)
    return _find(dht, dht_prefix, uids, latest=latest, timeout=timeout, beam_size=beam_size,
                 max_records=max_records_per_block)


def find_block_servers(
    dht: DHT, config: DistributedConfig, *, latest: bool = True, timeout: float | None = 30.0,
    beam_size: int | None = DEFAULT_BEAM_SIZE, max_records_per_block: int | None = None,
) -> SwarmState:
    """Who serves which block of ``config``'s model (all uids in ONE batched request).

    :param dht: a running ``hivemind.DHT`` (client mode is fine). A node started with
        ``start_local_dht(signed_records=True)`` accepts signed records only.
    :param config: a distributed config (``dht_prefix``, ``num_hidden_layers``).
    :param latest: look for the newest records (asks more peers) rather than any fresh one.
    :param timeout: give up after this many seconds (`TimeoutError`); keys whose search
        has not finished shortly before are reported in `SwarmState.failed` instead.
    :param beam_size: search beam (see `DEFAULT_BEAM_SIZE`; ``None`` = hivemind's default).
    :param max_records_per_block: records examined per block (default: the guard's cap,
        `distconf.dht.guard.MAX_RECORDS_PER_KEY`).
    :returns: a `SwarmState` with per-block servers (every state: callers choose, and
        routing uses ONLINE servers by default), merged spans and skipped entries.
    """
    uids = config_block_uids(config)
    return _find(dht, config_dht_prefix(config), uids, latest=latest, timeout=timeout, beam_size=beam_size,
                 max_records=max_records_per_block)


def _find(dht: DHT, prefix: str, uids: list[str], *, latest: bool, timeout: float | None,
          beam_size: int | None, max_records: int | None) -> SwarmState:
    from hivemind.utils import get_dht_time

    fetched = _fetch(dht, uids, latest=latest, timeout=timeout, beam_size=beam_size, prefix=prefix,
                     max_records=max_records)
    servers, skipped = parse_block_records(uids, fetched.items, now=get_dht_time(), signed=fetched.signed,
                                           max_records=max_records)
    skipped += [SkippedRecord(uid, subkey, f"{reason} (refused on arrival)")
                for uid in uids for subkey, reason in fetched.refused.get(uid, ())]
    if skipped:
        examples = "; ".join(f"{s.uid}[{s.subkey[:12]}]: {s.reason}" for s in skipped[:3])
        logger.warning("skipped %d unparsable DHT record(s) of %r: %s%s", len(skipped), prefix, examples,
                       " ..." if len(skipped) > 3 else "")
        for s in skipped[:100]:
            logger.debug("skipped DHT record %s[%s]: %s", s.uid, s.subkey, s.reason)
    if fetched.failed:
        first = next(iter(fetched.failed.items()))
        logger.warning("search failed for %d of %d block(s) of %r (%s: %s); the others are shown",
                       len(fetched.failed), len(uids), prefix, *first)
    return SwarmState(prefix, len(uids), servers, merge_spans(servers), skipped, dict(fetched.failed),
                      fetched.signed)


def read_model_listing(
    dht: DHT, *, latest: bool = True, timeout: float | None = 30.0
) -> tuple[dict[str, ModelInfo], dict[str, str]]:
    """Models listed under ``_petals.models``: ``({dht_prefix: ModelInfo}, {subkey: why skipped})``."""
    from hivemind.utils import get_dht_time

    fetched = _fetch(dht, [MODELS_REGISTRY_KEY], latest=latest, timeout=timeout, beam_size=DEFAULT_BEAM_SIZE)
    raw = fetched.items.get(MODELS_REGISTRY_KEY)
    models: dict[str, ModelInfo] = {}
    refused = fetched.refused.get(MODELS_REGISTRY_KEY, ())
    skipped = {subkey: f"{reason} (refused on arrival)" for subkey, reason in refused}
    if raw is None or raw[0] != "subkeys":
        return models, skipped
    now = get_dht_time()
    for subkey, value, expiration in raw[1]:
        if expiration is not None and expiration < now:
            continue
        problem = listing_prefix_problem(subkey)
        if problem is not None:
            skipped[repr(subkey)[:60]] = f"not a DHT prefix: {problem}"
            continue
        try:
            models[subkey] = ModelInfo.from_wire(value)
        except RecordError as e:
            skipped[subkey] = str(e)
    for subkey, reason in list(skipped.items())[:20]:
        logger.debug("skipped model listing %s: %s", subkey, reason)
    return models, skipped


def find_models(dht: DHT, *, latest: bool = True, timeout: float | None = 30.0) -> dict[str, ModelInfo]:
    """Public models listed under ``_petals.models``: ``{dht_prefix: ModelInfo}`` (bad entries skipped)."""
    return read_model_listing(dht, latest=latest, timeout=timeout)[0]
