"""Hardening of a hivemind DHT node against hostile peers, installed inside its process.

`install_guard` runs in the DHT process (through ``DHT.run_coroutine``) and is
idempotent. It gives the node:

1. the depth guard on hivemind's msgpack decoder, so crafted nesting raises instead of
   overflowing the C stack;
2. a `SwarmRecordValidator` (unless one is installed already);
3. **per-record** validation of dictionaries: hivemind drops a whole dictionary (every
   server of a block) when one of its records is invalid; the guard drops just that
   record, and validates at most ``max_records_per_key`` records of one dictionary
   (keeping the earliest stored: a flood of new subkeys cannot push out records that were
   there first), so the work per key stays bounded;
4. a cap on stored subkeys: the node stores at most ``max_records_per_key`` records under
   one swarm key (refreshes of records it holds are always accepted);
5. in searches, a dictionary's expiration is taken from its (validated) records, not from
   the responding peer's claim: a claim of ``+inf`` would otherwise end a "latest" search
   at once and hide every record not yet merged;
6. with the ``swarm`` scope (every key holds swarm records), at most
   ``4 * max_records_per_key`` records of a dictionary a peer sends are decoded.

This module holds the rules (what is kept, what is dropped, the bounds); how each is
hooked into hivemind is `distconf.dht.hivemind_compat` (items 1 to 5 there; item 1 in
`distconf.dht.hivemind_rpc_compat`). Each hook
keeps hivemind's behaviour for valid data within the bounds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from distconf.dht import hivemind_compat as compat
from distconf.dht.hivemind_rpc_compat import guard_msgpack_depth

if TYPE_CHECKING:  # pragma: no cover
    from hivemind.dht import DHTNode

    from distconf.dht.validators import SwarmRecordValidator

__all__ = ["MAX_RECORDS_PER_KEY", "Guard", "get_guard", "install_guard"]

logger = logging.getLogger(__name__)

MAX_RECORDS_PER_KEY = 256
"""Most records a guarded node stores, validates or returns under one swarm key (servers
of one block, or listed models). Petals 2.x swarms have a few dozen servers per block."""
_SCAN_FACTOR = 4  # records examined per kept record before the rest of a dictionary is dropped
_ACCEPTED_CACHE = 16384
_GUARD_ATTR = "_distconf_guard"


@dataclass
class Guard:
    """What `install_guard` installed on a node (kept on ``node.protocol``)."""

    validator: SwarmRecordValidator
    max_records_per_key: int = MAX_RECORDS_PER_KEY
    owner_marker: str | None = None
    dropped: dict[str, int] = field(default_factory=lambda: {"invalid": 0, "over_cap": 0})

    @property
    def signed(self) -> bool:
        """Whether this node writes and accepts signed server records only."""
        return self.validator.signed


def get_guard(node: DHTNode) -> Guard | None:
    """The guard installed on ``node``, if any."""
    return getattr(node.protocol, _GUARD_ATTR, None)


def install_guard(node: DHTNode, *, signed: bool = False, scope: str = "listed",
                  max_records_per_key: int = MAX_RECORDS_PER_KEY) -> Guard:
    """Harden ``node`` (call inside its DHT process); return its `Guard`. Idempotent.

    ``signed`` and ``scope`` configure the validator only when the node has none yet
    (nodes started by `start_local_dht` get theirs at construction).
    """
    guard = get_guard(node)
    if guard is not None:
        return guard
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.validation import CompositeValidator

    from distconf.dht.validators import SwarmRecordValidator

    guard_msgpack_depth()
    protocol = node.protocol
    if protocol.record_validator is None:
        protocol.record_validator = CompositeValidator()
    validators = compat.composite_validators(protocol.record_validator)
    ours = next((v for v in validators if isinstance(v, SwarmRecordValidator)), None)
    if ours is None:
        ours = SwarmRecordValidator(signed=signed, scope=scope)
        protocol.record_validator.extend([ours])
    rsa = next((v for v in validators if isinstance(v, RSASignatureValidator)), None)
    if ours.signed and rsa is None:
        raise ValueError("signed records need hivemind's RSASignatureValidator on the node")
    guard = Guard(ours, max(1, int(max_records_per_key)))
    if rsa is not None:
        guard.owner_marker = rsa.local_public_key.decode()
    compat.filter_dictionaries(protocol, _make_dictionary_filter(protocol, guard))
    for storage in (protocol.storage, protocol.cache):
        compat.cap_stored_subkeys(storage, partial(_subkey_cap, guard), partial(_count_over_cap, guard))
    compat.expire_dictionaries_by_records()
    if ours.scope == "swarm":  # every dictionary here is a swarm key's: none needs more records
        compat.bound_dictionary_decoding(_SCAN_FACTOR * guard.max_records_per_key)
    setattr(protocol, _GUARD_ATTR, guard)
    return guard


def _make_dictionary_filter(protocol: Any, guard: Guard) -> Any:
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import get_dht_time

    accepted: dict[tuple[bytes, Any, bytes], bool] = {}  # records the whole validator chain accepted

    def drop_invalid(key_bytes: bytes, dictionary: Any) -> None:
        """Drop invalid (and surplus) records of ``dictionary`` in place; keep the rest."""
        validator = protocol.record_validator
        capped = guard.validator.is_swarm_key(key_bytes)
        limit = guard.max_records_per_key
        latest = get_dht_time() + guard.validator.max_lifetime
        kept, drop = 0, []
        for index, (subkey, item) in enumerate(list(dictionary.items())):
            if capped and (kept >= limit or index >= _SCAN_FACTOR * limit):
                drop.append(subkey)
                guard.dropped["over_cap"] += 1
                continue
            try:  # validators are deterministic but for the expiration check: remember what passed
                cache_key: Any = (key_bytes, subkey, item.value)
                ok = item.expiration_time <= latest and cache_key in accepted
            except TypeError:  # an unhashable subkey
                cache_key, ok = None, False
            if not ok:
                try:
                    record = DHTRecord(key_bytes, protocol.serializer.dumps(subkey), item.value, item.expiration_time)
                    ok = validator is None or validator.validate(record)
                except Exception:
                    ok = False
                if ok and cache_key is not None:
                    if len(accepted) >= _ACCEPTED_CACHE:
                        accepted.pop(next(iter(accepted)))
                    accepted[cache_key] = True
            if ok:
                kept += 1
            else:
                drop.append(subkey)
                guard.dropped["invalid"] += 1
        for subkey in drop:
            del dictionary[subkey]

    return drop_invalid


def _subkey_cap(guard: Guard, key_bytes: bytes) -> int | None:
    """Most subkeys stored under ``key_bytes``: the guard's bound for swarm keys, none for others."""
    return guard.max_records_per_key if guard.validator.is_swarm_key(key_bytes) else None


def _count_over_cap(guard: Guard) -> None:
    guard.dropped["over_cap"] += 1
