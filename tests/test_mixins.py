"""Mixin field values are validated on construction, load and assignment."""

from __future__ import annotations

import json

import pytest

from distconf import ConfigValueError, load_family

BAD = [
    ("tuning_mode", "lora"), ("tuning_mode", True), ("pre_seq_len", -1), ("pre_seq_len", 1.5),
    ("show_route", "always"), ("show_route", 1), ("connect_timeout", 0), ("request_timeout", -5),
    ("update_period", float("nan")), ("daemon_startup_timeout", "60"), ("chunked_forward_step", 0),
    ("chunked_forward_step", True), ("use_chunked_forward", "yes"), ("initial_peers", "/ip4/127.0.0.1/tcp/1"),
    ("initial_peers", ["not-a-multiaddr"]), ("max_retries", -1), ("max_pinged", 2.5), ("ping_timeout", 0),
    ("min_backoff", 0), ("ban_timeout", None), ("use_server_to_server", "true"), ("allowed_servers", "peer"),
    ("blocked_servers", [1, 2]), ("active_adapter", 3), ("dht_prefix", "a.b"),
]


@pytest.mark.parametrize(("field", "value"), BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_bad_value_on_construction(field, value) -> None:
    cls = load_family("llama")
    with pytest.raises(ConfigValueError) as info:
        cls(**{field: value})
    assert f"{field}={value!r}" in str(info.value)


@pytest.mark.parametrize(("field", "value"), BAD[:8], ids=[f"{f}={v!r}" for f, v in BAD[:8]])
def test_bad_value_on_assignment(field, value) -> None:
    cfg = load_family("falcon")()
    with pytest.raises(ConfigValueError, match=field):
        setattr(cfg, field, value)


def test_bad_value_on_load(tmp_path) -> None:
    cls = load_family("mixtral")
    cls().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    data["show_route"] = "sometimes"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigValueError, match="show_route='sometimes'"):
        cls.from_pretrained(tmp_path)


def test_tuning_mode_needs_prefix_length() -> None:
    cls = load_family("bloom")
    with pytest.raises(ConfigValueError, match="pre_seq_len"):
        cls(tuning_mode="ptune")
    assert cls(tuning_mode="ptune", pre_seq_len=4).tuning_mode == "ptune"


def test_backoff_order() -> None:
    with pytest.raises(ConfigValueError, match="max_backoff"):
        load_family("bloom")(min_backoff=10, max_backoff=5)


@pytest.mark.parametrize(("field", "value"), [
    ("show_route", False), ("show_route", True), ("use_chunked_forward", True), ("max_retries", 0),
    ("initial_peers", ["/ip4/127.0.0.1/tcp/31337/p2p/QmX"]), ("connect_timeout", 0.5),
])
def test_good_values(field, value) -> None:
    assert getattr(load_family("llama")(**{field: value}), field) == value
