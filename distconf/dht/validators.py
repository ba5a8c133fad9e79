"""A hivemind record validator that refuses malformed swarm records at the door.

Installed on every DHT node distconf starts (`distconf.dht.start_local_dht`), and on any
other node the first time distconf reads or writes through it. hivemind calls
``validate`` when a peer asks the node to store a record *and* for every record a peer
returns to a search, so a node with this validator never stores, returns or passes on:

* a value that is not bounded, decodable msgpack (too big, nested too deep, a map with
  a non-string key: bytes that crash or hang hivemind's own decoder);
* a record that expires more than `MAX_RECORD_LIFETIME` from now (a far-future record
  would outlive, and block, every refresh of the record it replaces);
* under a block key: a plain value (which would replace every server record of the
  block), a subkey that is not a libp2p peer id, or a value that is not a valid server
  record (`ServerInfo`); with ``signed=True`` also a record whose subkey carries no owner
  key, or an owner key whose hash is not the subkey's peer id;
* under ``_petals.models``: a plain value, a subkey that is not a DHT prefix, or a value
  that is not a valid listing (`ModelInfo`);
* under a model's reports key (`distconf.loader.naming.reports_key`): a plain value, a
  subkey that is not a peer id (the same ownership rules as server records), or a value
  that is not a valid client report (`distconf.dht.report_records.ClientReport`).

Records written by Petals 2.x servers pass (``next_pings`` may hold ``+inf``).

Which keys are block keys? Keys are hashed before hivemind hands them to a validator, so
the validator cannot read them. With ``scope="swarm"`` (the default for nodes distconf
starts) every key other than ``_petals.models`` is a block key: a Petals swarm's DHT
holds nothing else but the clients' reports, which are told apart by their value: a server
record is a tuple, a report a dict (so a dict under a block key must be a valid report,
and is then skipped by discovery as any record that is not a server's). With
``scope="listed"`` (for DHTs that may be shared with other hivemind applications) only
the blocks and reports keys of models registered with `register_model` are, and other
keys are only checked for bounded, decodable values. On every node the keys of a
registered model are held to their own kind (a report under a registered block key, or
a server record under a registered reports key, is refused).
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from typing import Any

from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time

from distconf.dht.peerids import owner_matches_peer, peer_id_problem, split_subkey
from distconf.dht.records import (
    MAX_NUM_BLOCKS,
    MODELS_REGISTRY_KEY,
    ModelInfo,
    RecordError,
    ServerInfo,
    listing_prefix_problem,
)
from distconf.dht.report_records import MAX_REPORT_BYTES, report_problem
from distconf.dht.wire import MAX_VALUE_BYTES, WireError, safe_loads
from distconf.loader.naming import block_uids, reports_key

__all__ = ["MAX_RECORD_LIFETIME", "SCOPES", "SwarmRecordValidator", "key_id"]

logger = logging.getLogger(__name__)

MAX_RECORD_LIFETIME = 7 * 24 * 3600.0 + 60.0
"""Latest expiration accepted, in seconds from now (the longest `announce_blocks` lifetime
plus clock skew)."""
SCOPES = ("swarm", "listed")
"""``swarm``: every key but ``_petals.models`` holds server records; ``listed``: only the
blocks of registered models do."""
_PLAIN = b"\xc0"  # hivemind's subkey tag of a plain (non-dictionary) value: msgpack None
_MAX_SUBKEY_BYTES = 4096
_CACHE_SIZE = 8192
_NOTES_PER_KEY, _NOTED_KEYS = 8, 4096
_MAX_REGISTERED_KEYS = 1 << 18


@functools.lru_cache(maxsize=65536)
def key_id(key: str) -> bytes:
    """The bytes hivemind's validators see for ``key`` (its DHTID)."""
    from hivemind.dht.routing import DHTID

    return DHTID.generate(source=key).to_bytes()


class SwarmRecordValidator(RecordValidatorBase):
    """Refuses malformed server and model-listing records (see the module docstring).

    :param signed: block records must be signed by their peer (use together with
        hivemind's ``RSASignatureValidator``, which checks the signature first).
    :param scope: ``"swarm"`` or ``"listed"`` (which keys hold server records).
    :param max_lifetime: latest accepted expiration, in seconds from now.
    """

    def __init__(self, *, signed: bool = False, scope: str = "swarm",
                 max_lifetime: float = MAX_RECORD_LIFETIME) -> None:
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        self.signed = bool(signed)
        self.scope = scope
        self.max_lifetime = float(max_lifetime)
        self.registry_id = key_id(MODELS_REGISTRY_KEY)
        self.block_ids: set[bytes] = set()
        self.report_ids: set[bytes] = set()
        self.registered: dict[str, int] = {}
        self.refused = 0
        self.notes: OrderedDict[bytes, list[tuple[bytes, str]]] = OrderedDict()
        self._verdicts: OrderedDict[tuple[bytes, bytes, bytes], str | None] = OrderedDict()

    # ------------------------------------------------------------------ keys
    def register_model(self, dht_prefix: str, num_blocks: int) -> None:
        """Treat the block keys of ``dht_prefix`` (``num_blocks`` of them) as block keys."""
        num_blocks = max(0, min(int(num_blocks), MAX_NUM_BLOCKS))
        if self.registered.get(dht_prefix, 0) >= num_blocks or len(self.block_ids) >= _MAX_REGISTERED_KEYS:
            return
        start = self.registered.get(dht_prefix, 0)
        self.block_ids.update(map(key_id, block_uids(dht_prefix, start, num_blocks)))
        self.report_ids.add(key_id(reports_key(dht_prefix)))
        self.registered[dht_prefix] = num_blocks

    def is_block_key(self, key: bytes) -> bool:
        """Whether records under the (hashed) ``key`` must be server records."""
        if key == self.registry_id or key in self.report_ids:
            return False
        return self.scope == "swarm" or key in self.block_ids

    def is_swarm_key(self, key: bytes) -> bool:
        """Whether ``key`` holds swarm records (server records, model listings or client reports)."""
        return key == self.registry_id or key in self.report_ids or self.is_block_key(key)

    # ------------------------------------------------------------------ validation
    def validate(self, record: DHTRecord) -> bool:
        """hivemind's hook: True if the record may be stored and returned."""
        try:
            problem = self.problem(record)
        except Exception as e:  # never let a crafted record raise inside hivemind
            problem = f"validator error: {type(e).__name__}"
        if problem is not None:
            self.refused += 1
            self._note(record, problem)
            logger.debug("refused DHT record (subkey %r): %s", record.subkey[:60], problem)
        return problem is None

    def _note(self, record: DHTRecord, problem: str) -> None:
        """Remember (boundedly) why records of a key were refused, for the search that met them."""
        notes = self.notes.setdefault(record.key, [])
        self.notes.move_to_end(record.key)
        note = (record.subkey[:80], problem[:200])
        if len(notes) < _NOTES_PER_KEY and note not in notes:
            notes.append(note)
        while len(self.notes) > _NOTED_KEYS:
            self.notes.popitem(last=False)

    def take_notes(self, key: bytes) -> list[tuple[str, str]]:
        """``[(subkey, why refused), ...]`` noted for ``key`` since the last call (then forgotten)."""
        out = []
        for subkey, problem in self.notes.pop(key, []):
            if subkey == _PLAIN:
                shown = "(plain value)"
            else:
                try:
                    shown = str(safe_loads(subkey, max_bytes=_MAX_SUBKEY_BYTES, max_nesting=1))[:60]
                except WireError:
                    shown = subkey.hex()[:60]
            out.append((shown, problem))
        return out

    def problem(self, record: DHTRecord) -> str | None:
        """Why ``record`` is refused, or None if it is valid."""
        if not record.expiration_time <= get_dht_time() + self.max_lifetime:  # also refuses NaN
            return f"expires more than {self.max_lifetime:.0f} s from now"
        cache_key = (record.key, record.subkey, record.value)
        if cache_key in self._verdicts:
            self._verdicts.move_to_end(cache_key)
            return self._verdicts[cache_key]
        verdict = self._check(record)
        self._verdicts[cache_key] = verdict
        if len(self._verdicts) > _CACHE_SIZE:
            self._verdicts.popitem(last=False)
        return verdict

    def _check(self, record: DHTRecord) -> str | None:
        is_registry = record.key == self.registry_id
        if not self.is_swarm_key(record.key):
            try:  # someone else's key: only require bytes hivemind can decode safely
                safe_loads(record.value, other_ext=True)
                if record.subkey != _PLAIN:
                    safe_loads(record.subkey, max_bytes=_MAX_SUBKEY_BYTES, other_ext=True)
            except WireError as e:
                return str(e)
            return None
        if record.subkey == _PLAIN:
            return "a plain value where a dictionary of records belongs"
        try:
            subkey = safe_loads(record.subkey, max_bytes=_MAX_SUBKEY_BYTES, max_nesting=1)
            value = safe_loads(record.value, max_bytes=MAX_VALUE_BYTES)
        except WireError as e:
            return str(e)
        try:
            if is_registry:
                problem = listing_prefix_problem(subkey)
                if problem is not None:
                    return f"model listing subkey {subkey!r:.60}: {problem}"
                ModelInfo.from_wire(value)
                return None
            problem = self._check_server_subkey(subkey)
            if problem is not None:
                return problem
            if record.key in self.report_ids or (isinstance(value, dict) and record.key not in self.block_ids):
                if len(record.value) > MAX_REPORT_BYTES:
                    return f"a client report of {len(record.value)} bytes (at most {MAX_REPORT_BYTES})"
                problem = report_problem(value)
                return None if problem is None else f"client report: {problem}"
            return _server_record_problem(value)
        except RecordError as e:
            return str(e)

    def _check_server_subkey(self, subkey: Any) -> str | None:
        try:
            peer, owner = split_subkey(subkey)
        except ValueError as e:
            return str(e)
        problem = peer_id_problem(peer)
        if problem is not None:
            return f"subkey {peer!r:.60} is not a libp2p peer id: {problem}"
        if self.signed:
            if owner is None:
                return "unsigned server record (this swarm accepts signed records only)"
            if not owner_matches_peer(peer, owner):
                return "the owner key of the record is not the key of its peer id"
        elif owner is not None:
            return "signed server record (this node runs in Petals-compatible mode)"
        return None

    # ------------------------------------------------------------------ hivemind plumbing
    def merge_with(self, other: RecordValidatorBase) -> bool:
        """Absorb another `SwarmRecordValidator` (keeping the stricter settings)."""
        if not isinstance(other, SwarmRecordValidator):
            return False
        self.signed = self.signed or other.signed
        if other.scope == "swarm":
            self.scope = "swarm"
        self.max_lifetime = min(self.max_lifetime, other.max_lifetime)
        self.report_ids.update(other.report_ids)
        for prefix, n in other.registered.items():
            self.register_model(prefix, n)
        return True


def _server_record_problem(value: Any) -> str | None:
    ServerInfo.from_wire(value)
    return None
