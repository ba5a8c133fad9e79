"""The three mixins every distributed config inherits, plus revision pinning.

Their fields are plain config attributes: they are written to and read from
``config.json`` like any Hugging Face field. Every value is checked when it is set
(at construction, on load, or by assignment); a bad value raises `ConfigValueError`
naming the field and the value.
"""

from __future__ import annotations

import functools
import os
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, ConfigDict, Field, TypeAdapter, ValidationError

from distconf.errors import ConfigValueError
from distconf.loader.config_protocol import DistributedConfig
from distconf.loader.naming import config_block_uids, dht_prefix_problem

__all__ = [
    "ClientConfig", "PTuneConfig", "LMHeadConfig", "PinnedRevisionMixin", "MIXINS",
    "check_field", "check_cross_fields", "default_initial_peers", "mixin_field_docs",
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


def _is_multiaddr(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError("expected a multiaddr such as /ip4/127.0.0.1/tcp/31337/p2p/<id>")
    return value


def _is_dht_prefix(value: str | None) -> str | None:
    problem = None if value is None else dht_prefix_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


_FINITE = {"strict": True, "allow_inf_nan": False}
Seconds = Annotated[float, Field(gt=0, **_FINITE)]
"""A duration in seconds: a finite number > 0."""
Count = Annotated[int, Field(ge=0, strict=True)]
"""A whole number >= 0."""
Fraction = Annotated[float, Field(ge=0, le=1, **_FINITE)]
"""A share between 0 and 1."""
PeerIds = list[Annotated[str, Field(strict=True)]] | None
"""Base58 peer ids, or None for no restriction."""


def _field_type(owner: type, name: str) -> Any:
    return typing.get_type_hints(owner, include_extras=True)[name]


@functools.cache
def _adapter(name: str) -> TypeAdapter[Any] | None:
    for owner in MIXINS:
        if name in owner.__dataclass_fields__:
            return TypeAdapter(_field_type(owner, name), config=ConfigDict(strict=True))
    return None


def check_field(name: str, value: Any) -> None:
    """Raise `ConfigValueError` if ``value`` is not allowed for mixin field ``name``.

    The allowed values are the field's type annotation in its mixin (one home for each
    rule), checked strictly with pydantic: ``"60"`` is not a number, ``1`` is not ``True``.
    """
    adapter = _adapter(name)
    if adapter is None:
        return
    try:
        adapter.validate_python(value)
    except ValidationError as exc:
        reason = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors(include_url=False)[:1])
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise ConfigValueError(f"{name}={shown} is invalid: {reason}") from None


def check_cross_fields(config: DistributedConfig) -> None:
    """Checks that involve several fields; run once a config is fully built."""
    mode = getattr(config, "tuning_mode", None)
    pre_seq_len = getattr(config, "pre_seq_len", 0)
    if mode is not None and not pre_seq_len:
        raise ConfigValueError(f"tuning_mode={mode!r} needs pre_seq_len > 0, got pre_seq_len={pre_seq_len!r}")
    lo, hi = getattr(config, "min_backoff", 1), getattr(config, "max_backoff", 60)
    if hi < lo:
        raise ConfigValueError(f"max_backoff={hi!r} must be >= min_backoff={lo!r}")


Multiaddr = Annotated[str, Field(strict=True), AfterValidator(_is_multiaddr)]
"""A libp2p multiaddr such as ``/ip4/127.0.0.1/tcp/31337/p2p/<peer id>``."""
DhtPrefix = Annotated[str | None, AfterValidator(_is_dht_prefix)]
"""A DHT prefix usable in block uids (see `distconf.loader.naming`), or None."""


@dataclass(kw_only=True)
class ClientConfig:
    """How a client reaches the swarm: DHT prefix, peers, timeouts, retries, routing preferences."""

    initial_peers: list[Multiaddr] | tuple[Multiaddr, ...] = field(
        default_factory=default_initial_peers,
        metadata={"doc": "Multiaddrs of DHT peers to join through (default: DISTCONF_INITIAL_PEERS, else none; "
                         "there is no public bootstrap default)."})
    dht_prefix: DhtPrefix = field(default=None, metadata={
        "doc": "Prefix of the model's block uids on the DHT; derived from the hub id by from_pretrained."})
    daemon_startup_timeout: Seconds = field(default=60, metadata={
        "doc": "Seconds to wait for the local P2P daemon and DHT node to start."})
    show_route: bool | Literal["inference"] = field(default="inference", metadata={
        "doc": "Log the chosen route: always (true), never (false), or only for inference sessions."})
    allowed_servers: PeerIds = field(default=None, metadata={
        "doc": "Only route through these peer ids (None: any server)."})
    blocked_servers: PeerIds = field(default=None, metadata={"doc": "Never route through these peer ids."})
    use_server_to_server: bool = field(default=True, metadata={
        "doc": "Let a server push its outputs straight to the next server of the chain during inference."})
    connect_timeout: Seconds = field(default=5, metadata={"doc": "Seconds to open a connection to a server."})
    request_timeout: Seconds = field(default=180, metadata={"doc": "Seconds to wait for one request's reply."})
    update_period: Seconds = field(default=60, metadata={
        "doc": "Seconds between refreshes of the swarm's state from the DHT (and of a server's records)."})
    max_retries: Count | None = field(default_factory=_default_max_retries, metadata={
        "doc": "Retries of a failed request before giving up (None: keep trying; env DISTCONF_MAX_RETRIES)."})
    min_backoff: Seconds = field(default=1, metadata={"doc": "First delay between retries, in seconds."})
    max_backoff: Seconds = field(default=60, metadata={
        "doc": "Longest delay between retries (delays double from min_backoff up to this)."})
    ban_timeout: Seconds = field(default=15, metadata={
        "doc": "Seconds a server that failed a request is left out of routes."})
    active_adapter: Annotated[str, Field(strict=True)] | None = field(default=None, metadata={
        "doc": "Name of the adapter servers should apply to their blocks (None: the plain model)."})
    max_pinged: Count = field(default=3, metadata={
        "doc": "Candidate servers pinged per hop when choosing a route (0: no pings)."})
    ping_timeout: Seconds = field(default=2, metadata={
        "doc": "Seconds to wait for a ping; a server that does not answer counts as infinitely slow."})
    verify_fraction: Fraction = field(default=0.0, metadata={
        "doc": "Share of steps whose span results an independent server recomputes and compares (0: off); "
               "a check covers every step since the previous one, and a server's first step is always checked."})
    verify_tolerance: Annotated[float, Field(gt=0, **_FINITE)] | None = field(default=None, metadata={
        "doc": "Largest relative difference of a span's update taken as honest floating-point noise "
               "(None: the measured default for the dtype, see distconf.client.verify_compare)."})
    weights_manifest: Annotated[str, Field(strict=True, min_length=1)] | None = field(default=None, metadata={
        "doc": "Path of a `distconf manifest` file: servers whose announced per-block weight digests differ "
               "from it are refused (None: no commitment check)."})

    def block_uids(self, start: int = 0, end: int | None = None) -> list[str]:
        """DHT uids ``"<dht_prefix>.<i>"`` of blocks ``start..end-1`` (default: all); see `config_block_uids`."""
        return config_block_uids(self, start, end)


@dataclass(kw_only=True)
class PTuneConfig:
    """Prompt-tuning settings: trainable prefix length and mode."""

    pre_seq_len: Count = field(default=0, metadata={
        "doc": "Number of trainable prompt positions prepended to the input (0: no prompt tuning)."})
    tuning_mode: Literal["ptune", "deep_ptune"] | None = field(default=None, metadata={
        "doc": "'ptune': trainable input prompts; 'deep_ptune': also per-block prompts sent to servers."})


@dataclass(kw_only=True)
class LMHeadConfig:
    """Language-model head settings: chunked forward over the vocabulary."""

    use_chunked_forward: bool | Literal["auto"] = field(default="auto", metadata={
        "doc": "Compute logits in vocabulary chunks: 'auto' on CPU in half precision, or always/never."})
    chunked_forward_step: Annotated[int, Field(gt=0, strict=True)] = field(default=16384, metadata={
        "doc": "Vocabulary rows per chunk of the chunked LM head."})


MIXINS: tuple[type, ...] = (ClientConfig, PTuneConfig, LMHeadConfig)
"""The three mixins, in the order a distributed config inherits them."""


def mixin_field_docs() -> dict[str, str]:
    """``{field: documentation}`` of every mixin field."""
    return {name: f.metadata.get("doc", "") for owner in MIXINS for name, f in owner.__dataclass_fields__.items()}


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
