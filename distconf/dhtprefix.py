"""Derivation of a DHT prefix from a hub model id, following a family's rule."""

from __future__ import annotations

from distconf.errors import ConfigValueError
from distconf.spec import DhtPrefixRule

__all__ = ["derive_dht_prefix", "check_dht_prefix"]


def check_dht_prefix(prefix: str) -> str:
    """Return ``prefix`` if usable in block uids (no '.', no whitespace), else raise."""
    if not prefix or "." in prefix or any(c.isspace() for c in prefix):
        raise ConfigValueError(
            f"dht_prefix={prefix!r} is invalid: it must be non-empty, without '.' (uid delimiter) "
            "and without whitespace (chain delimiter)"
        )
    return prefix


def derive_dht_prefix(rule: DhtPrefixRule, model_name: str) -> str:
    """Apply ``rule`` to a hub id such as ``org/Model-70b-v1.5``."""
    prefix = str(model_name)
    if rule.name == "repo":
        prefix = prefix.split("/")[-1]
    for old, new in rule.replace.items():
        prefix = prefix.replace(old, new)
    if rule.suffix and not (rule.keep_existing_suffix and prefix.endswith(rule.suffix)):
        prefix += rule.suffix
    return check_dht_prefix(prefix)
