"""How blocks are named on the DHT: the one home of the uid rules and of DHT-prefix derivation.

A block uid is ``f"{dht_prefix}{UID_DELIMITER}{index}"`` (``"org/model-petals.17"``);
a chain of uids is joined by `CHAIN_DELIMITER`. A prefix therefore may contain neither
delimiter nor any whitespace. The family file's ``dht_prefix`` rule, the mixin field
``dht_prefix``, the DHT records and the server all check prefixes with `dht_prefix_problem`.

Every layer builds and reads uids through this module: `block_uid` / `block_uids` /
`config_block_uids` build them, `parse_block_uid` reads one, `chain_uid` / `split_chain`
join and split the chain a request names. `reports_key` names the key under which clients
publish the servers their spot checks caught (``"org/model-petals.reports"``: never a block
uid, whose index is digits).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from distconf.errors import ConfigValueError

__all__ = [
    "UID_DELIMITER", "CHAIN_DELIMITER", "dht_prefix_problem", "check_dht_prefix", "derive_dht_prefix",
    "block_uid", "block_uids", "parse_block_uid", "chain_uid", "split_chain",
    "config_dht_prefix", "config_num_blocks", "config_block_uids", "REPORTS_SUFFIX", "reports_key",
]

UID_DELIMITER = "."
"""Separates the DHT prefix from the block index in a block uid (Petals' UID_DELIMITER)."""
CHAIN_DELIMITER = " "
"""Separates the uids of a chain of blocks in one request (Petals' CHAIN_DELIMITER)."""
REPORTS_SUFFIX = "reports"
"""What follows the prefix and `UID_DELIMITER` in `reports_key` (not digits: no block uid looks like it)."""


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


def _uid(dht_prefix: str, index: int) -> str:
    return f"{dht_prefix}{UID_DELIMITER}{index}"  # the only place the format is written


def _check_index(name: str, index: object) -> int:
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ConfigValueError(f"{name} must be an integer >= 0, got {index!r}")
    return index


def block_uid(dht_prefix: str, index: int) -> str:
    """The DHT key of block ``index`` of the model with prefix ``dht_prefix``."""
    check_dht_prefix(dht_prefix)
    return _uid(dht_prefix, _check_index("block index", index))


def block_uids(dht_prefix: str, start: int, end: int) -> list[str]:
    """The uids of blocks ``start..end-1`` of the model with prefix ``dht_prefix``."""
    check_dht_prefix(dht_prefix)
    if _check_index("start", start) > _check_index("end", end):
        raise ConfigValueError(f"block range [{start}, {end}) has start > end")
    return [_uid(dht_prefix, i) for i in range(start, end)]


def chain_uid(dht_prefix: str, start: int, end: int) -> str:
    """The uids of blocks ``start..end-1`` joined into the one string a request names (``"m.2 m.3"``)."""
    return CHAIN_DELIMITER.join(block_uids(dht_prefix, start, end))


def split_chain(uids: str) -> list[str]:
    """The block uids of a chain string (no empty entries; nothing is validated)."""
    return [uid for uid in (uids or "").split(CHAIN_DELIMITER) if uid]


def reports_key(dht_prefix: str) -> str:
    """The DHT key of the clients' reports of servers caught computing wrong, for the model ``dht_prefix``."""
    return f"{check_dht_prefix(dht_prefix)}{UID_DELIMITER}{REPORTS_SUFFIX}"


def parse_block_uid(uid: str) -> tuple[str, int]:
    """Split ``"prefix.17"`` into ``("prefix", 17)``; raise `ValueError` otherwise."""
    prefix, sep, index = uid.rpartition(UID_DELIMITER)
    if not sep or dht_prefix_problem(prefix) is not None or not index.isdigit() or not index.isascii():
        raise ValueError(f"{uid[:80]!r} is not a block uid of the form 'prefix.index'")
    return prefix, int(index)


def config_dht_prefix(config: Any) -> str:
    """The ``dht_prefix`` of a config (any object with that attribute); `ConfigValueError` if it has none."""
    prefix = getattr(config, "dht_prefix", None)
    if prefix is None or prefix == "":
        raise ConfigValueError(
            f"{type(config).__name__} has no dht_prefix: load it by hub name with from_pretrained "
            "(which derives one) or pass dht_prefix=... explicitly"
        )
    return check_dht_prefix(prefix)


def config_num_blocks(config: Any) -> int:
    """Number of transformer blocks of a config (``num_hidden_layers``, or ``n_layer`` for old configs; a looped
    layer stack's unrolled count, `distconf.loader.layer_stack.block_count`)."""
    from distconf.loader.layer_stack import block_count

    if getattr(getattr(getattr(type(config), "family_spec", None), "block", None), "layer_stack", None) is not None:
        return block_count(config)
    n = getattr(config, "num_hidden_layers", None)
    if n is None:
        n = getattr(config, "n_layer", None)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigValueError(f"{type(config).__name__} has no valid num_hidden_layers (got {n!r})")
    return n


def config_block_uids(config: Any, start: int = 0, end: int | None = None) -> list[str]:
    """The uids of blocks ``start..end-1`` (default: all) of a config's model."""
    prefix = config_dht_prefix(config)
    n = config_num_blocks(config)
    end = n if end is None else end
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= n):
        raise ConfigValueError(f"block range [{start}, {end}) is outside [0, {n})")
    return block_uids(prefix, start, end)
