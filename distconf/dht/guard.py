"""Hardening of a hivemind DHT node against hostile peers, installed inside its process.

`install_guard` runs in the DHT process (through ``DHT.run_coroutine``) and is
idempotent. It gives the node:

1. the depth guard on hivemind's msgpack decoder (`distconf.dht.wire`), so crafted
   nesting raises instead of overflowing the C stack;
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
   ``4 * max_records_per_key`` records of a dictionary a peer sends are decoded;
7. hivemind's ``PeerID`` computes its base58 text lazily (a third of a client's CPU per
   discovery went to encoding neighbours' ids that are never printed).

Items 3 to 7 patch parts of hivemind 1.1.12 (``DHTProtocol._validate_dictionary``,
``DHTLocalStorage.store_subkey``, ``_SearchState.add_candidate``,
``DictionaryDHTValue.unpackb``, ``PeerID``) in the DHT process only; each patch keeps
hivemind's behaviour for valid data within the bounds.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distconf.dht.wire import guard_msgpack_depth

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
    validators = list(getattr(protocol.record_validator, "_validators", ()))
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
    protocol._validate_dictionary = types.MethodType(_make_dictionary_filter(guard), protocol)
    for storage in (protocol.storage, protocol.cache):
        storage.store_subkey = _capped_store_subkey(storage, guard)
    _patch_search_state()
    _lazy_peer_id_text()
    if ours.scope == "swarm":  # every dictionary here is a swarm key's: none needs more records
        _bound_dictionary_decoding(_SCAN_FACTOR * guard.max_records_per_key)
    setattr(protocol, _GUARD_ATTR, guard)
    return guard


def _make_dictionary_filter(guard: Guard) -> Any:
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import get_dht_time

    accepted: dict[tuple[bytes, Any, bytes], bool] = {}  # records the whole validator chain accepted

    def _validate_dictionary(protocol: Any, key_bytes: bytes, dictionary: Any) -> bool:
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
        return True

    return _validate_dictionary


def _capped_store_subkey(storage: Any, guard: Guard) -> Any:
    unguarded = storage.store_subkey

    def store_subkey(key: Any, subkey: Any, value: bytes, expiration_time: float) -> bool:
        from hivemind.dht.storage import DictionaryDHTValue

        if guard.validator.is_swarm_key(key.to_bytes()):
            current = storage.get(key)
            if (current is not None and isinstance(current.value, DictionaryDHTValue)
                    and subkey not in current.value and len(current.value) >= guard.max_records_per_key):
                guard.dropped["over_cap"] += 1
                return False
        return unguarded(key, subkey, value, expiration_time)

    return store_subkey


def _bound_dictionary_decoding(limit: int) -> None:
    """Decode at most ``limit`` records of any dictionary a peer sends (the rest would be dropped anyway).

    A peer that holds thousands of records under one key sends them all in one response;
    msgpack decodes the bytes quickly, but hivemind then stores every record one by one.
    """
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.utils.serializer import MSGPackSerializer

    if getattr(DictionaryDHTValue.unpackb, "_distconf_guard", False):
        return

    def unpackb(cls: type, raw: bytes) -> Any:
        maxsize, latest_expiration_time, items = MSGPackSerializer.loads(raw)
        with cls(maxsize).freeze() as new_dict:
            for key, value, expiration_time in items[:limit]:
                new_dict.store(key, value, expiration_time)
            new_dict.latest_expiration_time = latest_expiration_time
            return new_dict

    unpackb._distconf_guard = True  # type: ignore[attr-defined]
    DictionaryDHTValue.unpackb = classmethod(unpackb)  # type: ignore[method-assign]


def _lazy_peer_id_text() -> None:
    """Let hivemind's ``PeerID`` compute its base58 text when first asked, not when created.

    Every search response names up to 20 neighbours per key, and hivemind builds a PeerID
    for each, base58-encoding it in pure Python: about a third of a client's CPU during a
    discovery, for text that is almost never read. A pickled PeerID still carries its text.
    """
    import base58
    from hivemind.p2p import PeerID

    if getattr(PeerID.__init__, "_distconf_guard", False):
        return

    def __init__(self: Any, peer_id_bytes: bytes) -> None:
        self._bytes = peer_id_bytes

    def to_base58(self: Any) -> str:
        text = self.__dict__.get("_b58_str")
        if text is None:
            text = self._b58_str = base58.b58encode(self._bytes).decode()
        return text

    def __getstate__(self: Any) -> dict[str, Any]:
        to_base58(self)
        return dict(self.__dict__)

    __init__._distconf_guard = True  # type: ignore[attr-defined]
    PeerID.__init__ = __init__  # type: ignore[method-assign]
    PeerID.to_base58 = to_base58  # type: ignore[method-assign]
    PeerID.__getstate__ = __getstate__  # type: ignore[method-assign]


def _patch_search_state() -> None:
    from hivemind.dht import node as hivemind_node
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.utils.timed_storage import ValueWithExpiration

    search_state = hivemind_node._SearchState
    unguarded = search_state.add_candidate
    if getattr(unguarded, "_distconf_guard", False):
        return

    def add_candidate(self: Any, candidate: Any, source_node_id: Any) -> None:
        if candidate is not None and isinstance(candidate.value, DictionaryDHTValue):
            latest = max((item.expiration_time for _, item in candidate.value.items()), default=None)
            if latest is None:
                return  # nothing (valid and unexpired) in it
            if not candidate.expiration_time <= latest:
                candidate = ValueWithExpiration(candidate.value, latest)
        unguarded(self, candidate, source_node_id)

    add_candidate._distconf_guard = True  # type: ignore[attr-defined]
    search_state.add_candidate = add_candidate
