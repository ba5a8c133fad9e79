"""How blocks are named on the DHT: the one home of the uid rules and of DHT-prefix derivation.

A block uid is ``f"{dht_prefix}{UID_DELIMITER}{index}"`` (``"org/model-petals.17"``);
a chain of uids is joined by `CHAIN_DELIMITER`. A prefix therefore may contain neither
delimiter nor any whitespace. The family file's ``dht_prefix`` rule, the mixin field
``dht_prefix``, the DHT records and the server all check prefixes with `dht_prefix_problem`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from distconf.errors import ConfigValueError

__all__ = [
    "UID_DELIMITER", "CHAIN_DELIMITER", "dht_prefix_problem", "check_dht_prefix", "derive_dht_prefix",
    "block_uid", "parse_block_uid",
]

UID_DELIMITER = "."
"""Separates the DHT prefix from the block index in a block uid (Petals' UID_DELIMITER)."""
CHAIN_DELIMITER = " "
"""Separates the uids of a chain of blocks in one request (Petals' CHAIN_DELIMITER)."""


class PrefixRule(Protocol):
    """What `derive_dht_prefix` reads of a family's ``dht_prefix`` rule (`distconf.loader.spec.DhtPrefixRule`)."""

    name: str
    suffix: str
    keep_existing_suffix: bool
    replace: Mapping[str, str]


def dht_prefix_problem(prefix: object) -> str | None:
    """Why ``prefix`` cannot be used in block uids, or None when it can."""
    if not isinstance(prefix, str) or not prefix:
        return "it must be a non-empty string"
    if UID_DELIMITER in prefix:
        return f"it must not contain {UID_DELIMITER!r} (the block uid delimiter)"
    if any(c.isspace() for c in prefix):
        return "it must not contain whitespace (the chain delimiter)"
    return None


def check_dht_prefix(prefix: str) -> str:
    """Return ``prefix`` if usable in block uids, else raise `ConfigValueError`."""
    problem = dht_prefix_problem(prefix)
    if problem is not None:
        raise ConfigValueError(f"dht_prefix={prefix!r} is invalid: {problem}")
    return prefix


def derive_dht_prefix(rule: PrefixRule, model_name: str) -> str:
    """Apply a family's ``dht_prefix`` rule to a hub id such as ``org/Model-70b-v1.5``."""
    prefix = str(model_name)
    if rule.name == "repo":
        prefix = prefix.split("/")[-1]
    for old, new in rule.replace.items():
        prefix = prefix.replace(old, new)
    if rule.suffix and not (rule.keep_existing_suffix and prefix.endswith(rule.suffix)):
        prefix += rule.suffix
    return check_dht_prefix(prefix)


def block_uid(dht_prefix: str, index: int) -> str:
    """The DHT key of block ``index`` of the model with prefix ``dht_prefix``."""
    check_dht_prefix(dht_prefix)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ConfigValueError(f"block index must be an integer >= 0, got {index!r}")
    return f"{dht_prefix}{UID_DELIMITER}{index}"


def parse_block_uid(uid: str) -> tuple[str, int]:
    """Split ``"prefix.17"`` into ``("prefix", 17)``; raise `ValueError` otherwise."""
    prefix, sep, index = uid.rpartition(UID_DELIMITER)
    if not sep or dht_prefix_problem(prefix) is not None or not index.isdigit() or not index.isascii():
        raise ValueError(f"{uid[:80]!r} is not a block uid of the form 'prefix.index'")
    return prefix, int(index)
