"""The three mixins every distributed config inherits, plus revision pinning.

Their fields are plain config attributes: they are written to and read from
``config.json`` like any Hugging Face field. Every value is checked when it is set
(at construction, on load, or by assignment); a bad value raises `ConfigValueError`
naming the field and the value.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from distconf.errors import ConfigValueError

__all__ = [
    "ClientConfig", "PTuneConfig", "LMHeadConfig", "PinnedRevisionMixin",
    "FIELD_CHECKS", "check_field", "check_cross_fields", "default_initial_peers",
]

INITIAL_PEERS_ENV = "DISTCONF_INITIAL_PEERS"
MAX_RETRIES_ENV = "DISTCONF_MAX_RETRIES"


def default_initial_peers() -> list[str]:
    """Initial peers from ``DISTCONF_INITIAL_PEERS`` (whitespace/comma separated); else none.

    There is deliberately no public bootstrap default: a swarm is joined only through
    addresses the user gives.
    """
    raw = os.environ.get(INITIAL_PEERS_ENV, "")
    return [p for p in raw.replace(",", " ").split() if p]


def _default_max_retries() -> int | None:
    raw = os.environ.get(MAX_RETRIES_ENV)
    return int(raw) if raw not in (None, "") else None


def _bad(name: str, value: Any, expected: str) -> ConfigValueError:
    return ConfigValueError(f"{name}={value!r} is invalid: expected {expected}")


def _positive_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _bad(name, value, "a finite number > 0")


def _non_negative_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad(name, value, "an integer >= 0")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _bad(name, value, "an integer > 0")


def _optional_non_negative_int(name: str, value: Any) -> None:
    if value is not None:
        _non_negative_int(name, value)


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise _bad(name, value, "true or false")


def _optional_str(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise _bad(name, value, "a string or null")


def _optional_str_list(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise _bad(name, value, "a list of strings or null")


def _peers(name: str, value: Any) -> None:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise _bad(name, value, "a list of multiaddr strings")
    for peer in value:
        if not isinstance(peer, str) or not peer.startswith("/"):
            raise _bad(name, value, "a list of multiaddr strings such as /ip4/127.0.0.1/tcp/31337/p2p/<id>")


def _dht_prefix(name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not value:
        raise _bad(name, value, "a non-empty string or null")
    if "." in value or " " in value or any(c in value for c in "\t\n\r"):
        raise _bad(name, value, "no '.' (block uid delimiter) and no whitespace (chain delimiter)")


def _show_route(name: str, value: Any) -> None:
    if value not in (False, True, "inference") or (not isinstance(value, bool) and value != "inference"):
        raise _bad(name, value, 'false, true or "inference"')


def _tuning_mode(name: str, value: Any) -> None:
    if value not in (None, "ptune", "deep_ptune") or isinstance(value, bool):
        raise _bad(name, value, 'null, "ptune" or "deep_ptune"')


def _chunked(name: str, value: Any) -> None:
    if not (isinstance(value, bool) or value == "auto"):
        raise _bad(name, value, '"auto", true or false')


FIELD_CHECKS: dict[str, Callable[[str, Any], None]] = {
    "initial_peers": _peers,
    "dht_prefix": _dht_prefix,
    "daemon_startup_timeout": _positive_number,
    "show_route": _show_route,
    "allowed_servers": _optional_str_list,
    "blocked_servers": _optional_str_list,
    "use_server_to_server": _bool,
    "connect_timeout": _positive_number,
    "request_timeout": _positive_number,
    "update_period": _positive_number,
    "max_retries": _optional_non_negative_int,
    "min_backoff": _positive_number,
    "max_backoff": _positive_number,
    "ban_timeout": _positive_number,
    "active_adapter": _optional_str,
    "max_pinged": _non_negative_int,
    "ping_timeout": _positive_number,
    "pre_seq_len": _non_negative_int,
    "tuning_mode": _tuning_mode,
    "use_chunked_forward": _chunked,
    "chunked_forward_step": _positive_int,
}
"""Per-field checks of the mixin fields, applied on every assignment."""


def check_field(name: str, value: Any) -> None:
    """Raise `ConfigValueError` if ``value`` is not allowed for mixin field ``name``."""
    check = FIELD_CHECKS.get(name)
    if check is not None:
        check(name, value)


def check_cross_fields(config: Any) -> None:
    """Checks that involve several fields; run once a config is fully built."""
    mode = getattr(config, "tuning_mode", None)
    pre_seq_len = getattr(config, "pre_seq_len", 0)
    if mode is not None and not pre_seq_len:
        raise ConfigValueError(f"tuning_mode={mode!r} needs pre_seq_len > 0, got pre_seq_len={pre_seq_len!r}")
    lo, hi = getattr(config, "min_backoff", 1), getattr(config, "max_backoff", 60)
    if hi < lo:
        raise ConfigValueError(f"max_backoff={hi!r} must be >= min_backoff={lo!r}")


@dataclass(kw_only=True)
class ClientConfig:
    """How a client reaches the swarm: DHT prefix, peers, timeouts, retries."""

    initial_peers: list[str] = field(default_factory=default_initial_peers)
    dht_prefix: str | None = None
    daemon_startup_timeout: float = 60
    show_route: bool | Literal["inference"] = "inference"
    allowed_servers: list[str] | None = None
    blocked_servers: list[str] | None = None
    use_server_to_server: bool = True
    connect_timeout: float = 5
    request_timeout: float = 180
    update_period: float = 60
    max_retries: int | None = field(default_factory=_default_max_retries)
    min_backoff: float = 1
    max_backoff: float = 60
    ban_timeout: float = 15
    active_adapter: str | None = None
    max_pinged: int = 3
    ping_timeout: float = 2

    def block_uids(self, start: int = 0, end: int | None = None) -> list[str]:
        """DHT uids ``f"{dht_prefix}.{i}"`` of blocks ``start..end-1`` (default: all)."""
        if self.dht_prefix is None:
            raise ConfigValueError("dht_prefix is None: load the config with from_pretrained or pass dht_prefix")
        n = int(self.num_hidden_layers)
        end = n if end is None else end
        if not 0 <= start <= end <= n:
            raise ConfigValueError(f"block range [{start}, {end}) is outside [0, {n})")
        return [f"{self.dht_prefix}.{i}" for i in range(start, end)]


@dataclass(kw_only=True)
class PTuneConfig:
    """Prompt-tuning settings: trainable prefix length and mode."""

    pre_seq_len: int = 0
    tuning_mode: Literal["ptune", "deep_ptune"] | None = None


@dataclass(kw_only=True)
class LMHeadConfig:
    """Language-model head settings: chunked forward over the vocabulary."""

    use_chunked_forward: bool | Literal["auto"] = "auto"
    chunked_forward_step: int = 16384


class PinnedRevisionMixin:
    """Uses a pinned hub revision for known model ids when the caller gives none.

    The pins come from the family file (``revisions:``); the synthesized class sets
    ``pinned_revisions``.
    """

    pinned_revisions: ClassVar[dict[str, str]] = {}

    @classmethod
    def pinned_revision(cls, model_name_or_path: str) -> str | None:
        """The pinned revision for this hub id, if any."""
        return cls.pinned_revisions.get(str(model_name_or_path))

    @classmethod
    def from_pretrained(cls, model_name_or_path: Any, *args: Any, revision: str | None = None, **kwargs: Any) -> Any:
        """Load like the base config, defaulting ``revision`` to the pinned one."""
        if revision is None and not os.path.isdir(str(model_name_or_path)):
            revision = cls.pinned_revision(model_name_or_path)
        if revision is not None:
            kwargs["revision"] = revision
        return super().from_pretrained(model_name_or_path, *args, **kwargs)  # type: ignore[misc]
