"""Server and model-registry records: schema, rejection of bad values, exact wire round trip."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from hivemind.utils.serializer import MSGPackSerializer
from hypothesis import given, settings
from hypothesis import strategies as st

from distconf.dht.records import (
    MAX_NUM_BLOCKS,
    MAX_STR_LEN,
    ModelInfo,
    RecordError,
    ServerInfo,
    ServerState,
    block_uid,
    parse_block_uid,
)
from distconf.errors import ConfigValueError
from distconf.loader.naming import block_uids, config_block_uids, config_dht_prefix, config_num_blocks


def wire(value):
    """What another peer reads after a value crossed the DHT."""
    return MSGPackSerializer.loads(MSGPackSerializer.dumps(value))


FULL = ServerInfo(
    state=ServerState.ONLINE, throughput=123.5, start_block=3, end_block=7, public_name="alice",
    version="2.3.0", network_rps=1000.0, forward_rps=50.0, inference_rps=20.0, adapters=("lora-a", "lora-b"),
    torch_dtype="bfloat16", quant_type="nf4", using_relay=False, cache_tokens_left=16384,
    next_pings={"12D3KooWabc": 0.01},
)


def test_wire_format_matches_the_petals_layout():
    state, throughput, extra = FULL.to_wire()
    assert (state, throughput) == (2, 123.5)
    assert set(extra) == {
        "start_block", "end_block", "public_name", "version", "network_rps", "forward_rps", "inference_rps",
        "adapters", "torch_dtype", "quant_type", "using_relay", "cache_tokens_left", "next_pings",
    }
    assert extra["adapters"] == ("lora-a", "lora-b")


def test_exact_round_trip_through_hivemind_serializer():
    back = wire(FULL.to_wire())
    assert back == FULL.to_wire()
    assert isinstance(back, tuple)
    assert ServerInfo.from_wire(back) == FULL
    minimal = ServerInfo(state=1, throughput=0.0)
    assert ServerInfo.from_wire(wire(minimal.to_wire())) == minimal


def test_petals_short_forms_and_unknown_extra_keys():
    assert ServerInfo.from_wire((2, 1.0)).state is ServerState.ONLINE
    assert ServerInfo.from_wire([1, 3, {}]).throughput == 3.0  # list, int throughput: fine
    info = ServerInfo.from_wire((0, 2.0, {"future_field": [1, 2], "public_name": "bob"}))
    assert info.public_name == "bob" and info.state is ServerState.OFFLINE
    assert not hasattr(info, "future_field")


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("garbage", "tuple"),
        (b"\x00\x01", "tuple"),
        ((2,), "tuple"),
        ((2, 1.0, {}, 4), "tuple"),
        ((3, 1.0, {}), "state"),
        ((-1, 1.0, {}), "state"),
        ((2**64 - 1, 1.0, {}), "state"),
        ((True, 1.0, {}), "state"),
        (("2", 1.0, {}), "state"),
        ((2, -0.5, {}), "throughput"),
        ((2, math.nan, {}), "throughput"),
        ((2, math.inf, {}), "throughput"),
        ((2, "fast", {}), "throughput"),
        ((2, False, {}), "throughput"),
        ((2, 1.0, [1, 2]), "extra"),
        ((2, 1.0, {1: 2}), "string keys"),
        ((2, 1.0, {"cache_tokens_left": -1}), "cache_tokens_left"),
        ((2, 1.0, {"cache_tokens_left": 1.5}), "cache_tokens_left"),
        ((2, 1.0, {"cache_tokens_left": 2**64 - 1}), "cache_tokens_left"),
        ((2, 1.0, {"public_name": "x" * (MAX_STR_LEN + 1)}), "public_name"),
        ((2, 1.0, {"public_name": 5}), "public_name"),
        ((2, 1.0, {"adapters": "lora"}), "adapters"),
        ((2, 1.0, {"adapters": [1]}), "adapters"),
        ((2, 1.0, {"using_relay": "yes"}), "using_relay"),
        ((2, 1.0, {"next_pings": {"p": -1.0}}), "next_pings"),
        ((2, 1.0, {"forward_rps": math.inf}), "forward_rps"),
        ((2, 1.0, {"start_block": 5, "end_block": 5}), "start_block"),
    ],
)
def test_bad_server_records_are_rejected(value, fragment):
    with pytest.raises(RecordError, match=fragment):
        ServerInfo.from_wire(value)
    if not isinstance(value, tuple) or not any(isinstance(x, dict) and 1 in x for x in value):
        with pytest.raises(RecordError, match=fragment):  # msgpack refuses int map keys on the way back
            ServerInfo.from_wire(wire(value))


# What a Petals 2.x server stores: ``ServerInfo.to_tuple()`` (``dataclasses.asdict`` keeps the
# field order) and ``ModelInfo.to_dict()``, written out by hand here.
PETALS_PEER = "12D3KooWDErGmEBoDjwZFhQtEgQsES3qP8qCYHxXqM69rt6Cvi2e"
PETALS_TUPLE = (2, 1234.5, {
    "start_block": 3, "end_block": 7, "public_name": "petals-server", "version": "2.3.0.dev2",
    "network_rps": 1000.0, "forward_rps": 900.0, "inference_rps": 300.0, "adapters": ("lora-a",),
    "torch_dtype": "bfloat16", "quant_type": "nf4", "using_relay": False, "cache_tokens_left": 163840,
    "next_pings": {PETALS_PEER: 0.012, "12D3KooWfailed": math.inf},
})


def test_petals_records_are_read_and_written_byte_for_byte():
    raw = MSGPackSerializer.dumps(PETALS_TUPLE)
    info = ServerInfo.from_wire(MSGPackSerializer.loads(raw))
    assert info.next_pings["12D3KooWfailed"] == math.inf  # a failed ping (Petals' mark) stays valid
    assert MSGPackSerializer.dumps(info.to_wire()) == raw
    minimal = (1, 0.0, {k: None for k in PETALS_TUPLE[2]} | {"adapters": ()})  # a fresh Petals ServerInfo
    assert MSGPackSerializer.dumps(ServerInfo(state=1, throughput=0.0).to_wire()) == MSGPackSerializer.dumps(minimal)
    listing = {"num_blocks": 80, "repository": "https://huggingface.co/meta-llama/Llama-2-70b-hf"}
    assert MSGPackSerializer.dumps(ModelInfo.from_wire(listing).to_wire()) == MSGPackSerializer.dumps(listing)
    assert MSGPackSerializer.dumps(ModelInfo(num_blocks=8).to_wire()) == MSGPackSerializer.dumps(
        {"num_blocks": 8, "repository": None})


@pytest.mark.parametrize("bad", [math.nan, -1.0, -math.inf, "1", True])
def test_bad_pings_are_rejected(bad):
    with pytest.raises(RecordError, match="next_pings"):
        ServerInfo.from_wire((2, 1.0, {"next_pings": {PETALS_PEER: bad}}))


def test_model_info_round_trip_and_rejection():
    info = ModelInfo(num_blocks=80, repository="https://huggingface.co/meta-llama/Llama-2-70b-hf")
    assert wire(info.to_wire()) == {"num_blocks": 80, "repository": info.repository}
    assert ModelInfo.from_wire(wire(info.to_wire())) == info
    assert ModelInfo.from_wire({"num_blocks": 2, "extra": 1}) == ModelInfo(num_blocks=2)
    for bad in ({"num_blocks": 0}, {"num_blocks": "80"}, {"num_blocks": True}, {}, [80],
                {"num_blocks": 2, "repository": 3}, {"num_blocks": 2**63}, {"num_blocks": MAX_NUM_BLOCKS + 1}):
        with pytest.raises(RecordError):
            ModelInfo.from_wire(bad)


def test_block_uids():
    assert block_uid("Llama-2-70b-hf", 17) == "Llama-2-70b-hf.17"
    assert parse_block_uid("bigscience/bloom-petals.3") == ("bigscience/bloom-petals", 3)
    for bad in ("a.b", "a b"):
        with pytest.raises(ValueError, match="must not contain"):
            block_uid(bad, 0)
    for bad in ("nodot", "x.", ".3", "x.-1", "x.1 x.2"):
        with pytest.raises(ValueError, match="block uid"):
            parse_block_uid(bad)


def test_block_uid_ranges():
    assert block_uids("m", 1, 3) == ["m.1", "m.2"] == [block_uid("m", 1), block_uid("m", 2)]
    assert block_uids("m", 2, 2) == []
    assert all(parse_block_uid(uid) == ("m", i) for i, uid in enumerate(block_uids("m", 0, 5)))
    for args, fragment in ((("m", 3, 2), "start > end"), (("m", -1, 2), "start must be"),
                           (("m", 0, True), "end must be"), (("a b", 0, 1), "must not contain"),
                           (("", 0, 1), "non-empty")):
        with pytest.raises(ConfigValueError, match=fragment):
            block_uids(*args)


def test_config_block_uids_read_any_config():
    """The rule the config mixin's ``block_uids`` and the DHT helpers share (plain objects work too)."""
    cfg = SimpleNamespace(dht_prefix="org/m-petals", num_hidden_layers=3)
    assert config_block_uids(cfg) == ["org/m-petals.0", "org/m-petals.1", "org/m-petals.2"]
    assert config_block_uids(cfg, 1) == ["org/m-petals.1", "org/m-petals.2"]
    assert config_block_uids(cfg, 1, 1) == []
    assert config_num_blocks(SimpleNamespace(n_layer=4)) == 4
    for start, end in ((0, 4), (2, 1), (-1, 2)):
        with pytest.raises(ConfigValueError, match=r"outside \[0, 3\)"):
            config_block_uids(cfg, start, end)
    for bad in (SimpleNamespace(num_hidden_layers=2), SimpleNamespace(dht_prefix=None, num_hidden_layers=2)):
        with pytest.raises(ConfigValueError, match="has no dht_prefix"):
            config_dht_prefix(bad)
    with pytest.raises(ConfigValueError, match="must not contain"):
        config_dht_prefix(SimpleNamespace(dht_prefix="a.b"))
    for n in (None, 0, True, "3"):
        with pytest.raises(ConfigValueError, match="no valid num_hidden_layers"):
            config_num_blocks(SimpleNamespace(num_hidden_layers=n))


def test_hub_repository_from_a_hub_id_or_a_cache_snapshot(tmp_path):
    from distconf.dht.announce import hub_repository
    from distconf.server import hub_repository as served

    assert served is hub_repository  # one function: the server announces with the DHT's rule
    assert hub_repository("org/Model-v1.5") == "https://huggingface.co/org/Model-v1.5"
    assert hub_repository("gpt2") == "https://huggingface.co/gpt2"
    snapshot = tmp_path / "hub" / "models--org--Model-7b" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert hub_repository(snapshot) == hub_repository(str(snapshot)) == "https://huggingface.co/org/Model-7b"
    for other in (tmp_path, str(tmp_path), None, "", "../org/m", "org/a--b", "a/b/c", "/no/such/dir"):
        assert hub_repository(other) is None, other


_finite = st.floats(min_value=0, max_value=1e12, allow_nan=False, allow_infinity=False)
_text = st.text(max_size=40)
_opt = st.none().__or__


@settings(max_examples=200, deadline=None)
@given(
    state=st.sampled_from(list(ServerState)),
    throughput=_finite,
    span=st.none() | st.tuples(st.integers(0, 1000), st.integers(1, 1000)),
    public_name=_opt(_text),
    rps=_opt(_finite),
    adapters=st.lists(_text, max_size=4).map(tuple),
    using_relay=_opt(st.booleans()),
    cache=_opt(st.integers(0, 2**40)),
    pings=_opt(st.dictionaries(_text, _finite, max_size=4)),
)
def test_round_trip_property(state, throughput, span, public_name, rps, adapters, using_relay, cache, pings):
    start, end = (None, None) if span is None else (span[0], span[0] + span[1])
    info = ServerInfo(state=state, throughput=throughput, start_block=start, end_block=end,
                      public_name=public_name, inference_rps=rps, adapters=adapters, using_relay=using_relay,
                      cache_tokens_left=cache, next_pings=pings)
    assert wire(info.to_wire()) == info.to_wire()
    assert ServerInfo.from_wire(wire(info.to_wire())) == info


_msgpack_leaf = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8) \
    | st.binary(max_size=8)
_msgpack = st.recursive(
    _msgpack_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.lists(inner, max_size=4).map(tuple)
    | st.dictionaries(st.text(max_size=12) | st.integers(0, 9), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(value=_msgpack | st.tuples(st.integers(-2, 4), _msgpack_leaf, st.dictionaries(
    st.sampled_from(["start_block", "end_block", "adapters", "next_pings", "cache_tokens_left", "x"]), _msgpack)))
def test_arbitrary_data_parses_or_raises_record_error(value):
    """A hostile peer can store any msgpack value: parsing never fails any other way."""
    try:
        value = wire(value)
    except ValueError:  # int map keys: msgpack refuses them on load; parse the raw value instead
        pass
    try:
        info = ServerInfo.from_wire(value)
    except RecordError:
        return
    assert math.isfinite(info.throughput) and info.throughput >= 0
    assert info.state in (0, 1, 2)
