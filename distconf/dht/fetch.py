"""One batched, guarded DHT search whose keys fail independently.

`fetch_raw` (and the internal ``_fetch``) run ONE ``get_many`` inside the DHT process
for many keys. The node is guarded first (`distconf.dht.guard`), so a bad record is
dropped on arrival without touching the others; each key's search then completes on its
own: a key whose search fails, or has not finished shortly before the caller's timeout,
is reported as failed while every other key is returned. At most
``max_records_per_key`` records per key travel back to the caller.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from distconf.loader.naming import block_uids

if TYPE_CHECKING:  # pragma: no cover
    from hivemind import DHT
    from hivemind.dht import DHTNode

__all__ = ["DEFAULT_BEAM_SIZE", "fetch_raw"]

logger = logging.getLogger(__name__)

DEFAULT_BEAM_SIZE = 5
"""Nodes kept in the search beam when looking for the latest records: hivemind stores
every record on its ``num_replicas`` (5) nearest nodes, so a beam of 5 visits the
replica set; hivemind's own default (``bucket_size``, 20) also visits nodes that can
only hold caches, at about twice the cost on a small swarm. ``None`` = hivemind's default."""


async def _get_many(
    dht: DHT, node: DHTNode, keys: list[str] | None, latest: bool, beam_size: int | None = None,
    prefix: str | None = None, num_blocks: int = 0, deadline: float | None = None,
    max_records: int | None = None,
) -> dict[str, Any]:
    """Runs in the DHT process: one batched search, each key finishing on its own.

    Block uids may be given compactly as ``prefix`` + ``num_blocks``: what travels to the
    DHT process through its pipe stays small (hivemind reads that pipe non-blocking, and
    a message larger than the pipe buffer can be lost). Returns plain data:
    ``{"items": {key: entry}, "failed": {key: reason}, "signed": bool, "refused": {key:
    [(subkey, reason), ...]}}`` (records this node refused while the search ran).
    """
    from distconf.dht.guard import install_guard
    from distconf.dht.validators import key_id

    guard = install_guard(node)
    if keys is None:
        keys = block_uids(prefix, 0, num_blocks)
        guard.validator.register_model(prefix, num_blocks)
    ids = {key: key_id(key) for key in keys}
    for key_bytes in ids.values():
        guard.validator.take_notes(key_bytes)  # forget refusals from before this search
    limit = guard.max_records_per_key if max_records is None else max(1, int(max_records))
    kwargs: dict[str, Any] = {"num_workers": max(1, len(keys)), "return_futures": True}
    if beam_size is not None:
        kwargs["beam_size"] = beam_size
    if latest:
        kwargs["sufficient_expiration_time"] = math.inf
    futures = await node.get_many(keys, **kwargs)
    pending_futures = set(futures.values())
    if pending_futures:
        _, pending = await asyncio.wait(pending_futures, timeout=deadline)
    else:
        pending = set()
    items: dict[str, Any] = {}
    failed: dict[str, str] = {}
    for key in keys:
        future = futures[key]
        if future in pending:
            future.cancel()
            failed[key] = f"no answer within {deadline:.1f} s"
        elif future.cancelled() or future.exception() is not None:
            failed[key] = f"search failed: {future.exception()!r}"[:200] if not future.cancelled() else "cancelled"
        else:
            items[key] = _flatten(future.result(), limit)
    refused = {key: notes for key in keys if (notes := guard.validator.take_notes(ids[key]))}
    return {"items": items, "failed": failed, "signed": guard.signed, "refused": refused}


def _flatten(item: Any, limit: int) -> Any:
    if item is None:
        return None
    if isinstance(item.value, dict):
        records = [(sub, v.value, v.expiration_time) for sub, v in list(item.value.items())[:limit]]
        return ("subkeys", records)
    return ("value", item.value, item.expiration_time)


@dataclass
class _Fetched:
    items: dict[str, Any]
    failed: dict[str, str]
    signed: bool
    refused: dict[str, list[tuple[str, str]]]


def _fetch(
    dht: DHT, keys: list[str], *, latest: bool, timeout: float | None, beam_size: int | None,
    prefix: str | None = None, max_records: int | None = None,
) -> _Fetched:
    keys = list(keys)
    # the DHT process answers (with whatever keys finished) a little before the caller gives up
    deadline = None if timeout is None else max(0.2, min(timeout - 0.5, 0.9 * timeout))
    common = dict(latest=latest, beam_size=beam_size, deadline=deadline, max_records=max_records)
    if prefix is not None and keys == block_uids(prefix, 0, len(keys)):
        job = partial(_get_many, keys=None, prefix=prefix, num_blocks=len(keys), **common)
    else:
        job = partial(_get_many, keys=keys, **common)
    future = dht.run_coroutine(job, return_future=True)
    try:
        out = future.result(timeout=timeout)
    except BaseException:
        future.cancel()
        raise
    return _Fetched(out["items"], out["failed"], out["signed"], out["refused"])


def fetch_raw(
    dht: DHT, keys: list[str], *, latest: bool = True, timeout: float | None = 30.0,
    beam_size: int | None = DEFAULT_BEAM_SIZE, _prefix: str | None = None,
) -> dict[str, Any]:
    """Read ``keys`` with one batched request; return plain, unvalidated data per key.

    Each value is ``None`` (not found, or its search failed: logged),
    ``("subkeys", [(subkey, value, expiration), ...])`` or ``("value", value, expiration)``.
    """
    fetched = _fetch(dht, keys, latest=latest, timeout=timeout, beam_size=beam_size, prefix=_prefix)
    for key, reason in fetched.failed.items():
        logger.warning("DHT key %r: %s", key, reason)
    return {key: fetched.items.get(key) for key in keys}


