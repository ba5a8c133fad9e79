"""``distconf monitor`` on a real hivemind DHT (127.0.0.1 only) and a real uvicorn server.

One module-scoped swarm: a bootstrap node, three honest servers, an attacker (a plain
hivemind node, without distconf's validator) that stores garbage under the model's keys
and in the model listing, and the monitor's client node. The monitor reads the swarm every
`REFRESH` seconds and is queried over HTTP like any script would. Every wait is bounded.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from dhthelpers import stand_in_config
from dhthelpers import wait_for as _wait_for
from swarm_harness import Swarm, dht_node
from test_dht_hostile import made_up_peer_id, store_raw

from distconf.cli import cmd_monitor
from distconf.client.verify_events import VerificationEvent
from distconf.dht import (
    BlockAnnouncer,
    ServerInfo,
    ServerState,
    SwarmState,
    announce_blocks,
    find_block_servers,
)
from distconf.dht.discovery import merge_spans
from distconf.dht.reports import ReportPublisher
from distconf.loader.naming import reports_key
from distconf.monitor import Monitor, Snapshot, SwarmStateV1, build_app, dht_reader, start_in_thread, state_of
from distconf.monitor.snapshot import model_state

REPO = Path(__file__).resolve().parents[1]
REFRESH = 1.0
PREFIX = "monitor-swarm-hf"
LEAVE_PREFIX = "monitor-leave-hf"
HOSTILE_NAME = '<img src=x onerror="document.title=1">'


wait_for = functools.partial(_wait_for, timeout=60.0, interval=0.2)  # the page refreshes in the background


def model(prefix: str = PREFIX, n: int = 8):
    """A stand-in config of ``n`` blocks under ``prefix``."""
    return stand_in_config(prefix, n)


def get(url: str, host: str | None = None, timeout: float = 20.0) -> tuple[int, dict, bytes]:
    """(status, headers, body) of a GET (bounded by ``timeout``)."""
    request = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def state(url: str, query: str = "") -> dict:
    """``/api/v1/state`` as a dict, validated against the schema."""
    status, _, body = get(f"{url}/api/v1/state{query}")
    assert status == 200, body
    return SwarmStateV1.model_validate_json(body).model_dump()


def find(data: dict, prefix: str) -> dict | None:
    """The model ``prefix`` in a state, or None."""
    return next((m for m in data["models"] if m["dht_prefix"] == prefix), None)


def start_monitor(client, refresh: float = REFRESH, extra: dict | None = None):
    """A monitor over ``client`` served on 127.0.0.1 (the app starts and stops the monitor's thread)."""
    monitor = Monitor(dht_reader(client, extra, timeout=20.0), refresh=refresh)
    return monitor, start_in_thread(build_app(monitor))


@pytest.fixture(scope="module")
def swarm():
    with Swarm() as s:
        a, b, c = (s.node() for _ in range(3))
        attacker = s.plain_node()
        client = s.node(client_mode=True)
        cfg = model()
        announce_blocks(a, cfg, 0, 5, ServerInfo(state=ServerState.ONLINE, throughput=10.0, public_name=HOSTILE_NAME,
                                                 cache_tokens_left=4096, torch_dtype="bfloat16",
                                                 next_pings={b.peer_id.to_base58(): 0.01, "x": float("inf")}))
        announce_blocks(b, cfg, 3, 8, ServerInfo(state=ServerState.ONLINE, throughput=5.0, public_name="b",
                                                 quant_type="nf4", version="2.3.0"))
        announce_blocks(c, cfg, 5, 8, ServerInfo(state=ServerState.JOINING, throughput=50.0, public_name="c"))
        evil = made_up_peer_id("monitor-evil")
        store_raw(attacker, [(f"{PREFIX}.2", evil, (7, "fast", {}), 600),             # unknown state
                             (f"{PREFIX}.4", "not-a-peer-id", (2, 1.0, {}), 600),       # bad subkey
                             ("_petals.models", "bad listing", {"num_blocks": -3}, 600),
                             ("_petals.models", "evil-model-hf", {"num_blocks": "many"}, 600)])
        monitor, running = start_monitor(client)
        s.on_close(running.stop)
        ids = {n: d.peer_id.to_base58() for n, d in zip("abc", (a, b, c), strict=True)}
        yield SimpleNamespace(a=a, b=b, c=c, client=client, cfg=cfg, url=running.url, monitor=monitor,
                              attacker=attacker, ids=ids)


BAD_BLOCK_RECORDS = 2
"""The attacker's block records the fixture stores (an unknown state, a bad subkey)."""


def read_with_all_three(swarm) -> dict:
    """The monitor's state once it shows the three servers and skips both of the attacker's block records
    (under load a refresh may land before a store has reached every node)."""
    def ready():
        data = state(swarm.url)
        found = find(data, PREFIX)
        seen = found is not None and found["peers_total"] == 3 and found["skipped_records"] == BAD_BLOCK_RECORDS
        return data if seen else None

    data = wait_for(ready)
    assert data, "the monitor never showed the three servers"
    return data


# --------------------------------------------------------------------------- the JSON is discovery's view
def test_state_matches_find_block_servers(swarm):
    data = read_with_all_three(swarm)
    shown = find(data, PREFIX)
    def discovered():
        found = find_block_servers(swarm.client, swarm.cfg)
        return found if len(found.skipped) == BAD_BLOCK_RECORDS else None

    truth = wait_for(discovered) or find_block_servers(swarm.client, swarm.cfg)
    assert [(s["peer_id"], s["start"], s["end"], s["state"], s["throughput"]) for s in shown["servers"]] == [
        (s.peer_id, s.start, s.end, s.state.name.lower(), s.throughput) for s in truth.spans]
    assert shown["online_per_block"] == [sum(i.state == ServerState.ONLINE for i in block.values())
                                         for block in truth.servers] == [1, 1, 1, 2, 2, 1, 1, 1]
    assert shown["joining_per_block"] == [0, 0, 0, 0, 0, 1, 1, 1]
    assert shown["num_blocks"] == 8 and shown["listed"] and shown["blocks_covered"] == 8
    assert shown["peers_by_state"] == {"offline": 0, "joining": 1, "online": 2}
    row = shown["servers"][0]
    assert row["public_name"] == HOSTILE_NAME  # text, kept as is: the page sets it as text only
    assert row["cache_tokens_left"] == 4096 and row["torch_dtype"] == "bfloat16"
    assert row["next_pings"] == {swarm.ids["b"]: 0.01, "x": None}  # fastest first; a failed ping is null
    assert row["peer_id_short"] == ".." + swarm.ids["a"][-8:]
    # the attacker's records are skipped exactly as discovery skips them; the listing's bad entries too
    assert shown["skipped_records"] == len(truth.skipped) == BAD_BLOCK_RECORDS
    assert data["skipped_listings"] >= 1
    assert "evil-model-hf" not in [m["dht_prefix"] for m in data["models"]]
    assert data["schema_version"] == 1 and data["age_seconds"] >= 0 and data["refresh_seconds"] == REFRESH


def test_route_and_metrics(swarm):
    data = read_with_all_three(swarm)
    route = find(data, PREFIX)["route"]
    assert route["exists"] and route["hops"] == 2 and route["bottleneck_rps"] == 5.0  # joining c is not used
    status, headers, body = get(f"{swarm.url}/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    text = body.decode()
    samples = dict(re.findall(r"^(distconf_monitor_\S+) (\S+)$", text, re.M))
    label = f'{{model="{PREFIX}"}}'
    assert samples[f"distconf_monitor_blocks{label}"] == "8"
    assert samples[f"distconf_monitor_blocks_covered{label}"] == "8"
    assert samples[f"distconf_monitor_route_exists{label}"] == "1"
    assert samples[f"distconf_monitor_route_bottleneck_rps{label}"] == "5"
    assert samples[f'distconf_monitor_servers{{model="{PREFIX}",state="joining"}}'] == "1"
    assert float(samples["distconf_monitor_snapshot_age_seconds"]) >= 0
    for line in text.splitlines():  # every line is a comment or a well-formed sample
        assert line.startswith("# ") or re.fullmatch(r'distconf_monitor_[a-z_]+(\{[^}]*\})? -?[0-9.e+-]+', line)


def test_servers_clients_caught_are_shown_as_claims(swarm):
    """A client's published report of a caught server reaches the JSON and the metrics; garbage is skipped."""
    liar = swarm.ids["b"]
    publisher = ReportPublisher(swarm.client, PREFIX, 8)
    publisher(VerificationEvent(peer_id=liar, start=3, end=8, step=5, position=9, difference=0.25,
                                tolerance=0.01, checkers=(swarm.ids["c"],)))
    assert publisher.flush(30.0)
    store_raw(swarm.attacker, [(reports_key(PREFIX), made_up_peer_id("bad-reporter"),
                                {"caught": [{"peer_id": "junk", "start": 0, "end": 1}]}, 600)])
    shown = wait_for(lambda: (m := find(state(swarm.url), PREFIX)) and m["caught"] and m)
    assert shown, "the report never reached the monitor"
    row = shown["caught"][0]
    assert (row["peer_id"], row["start"], row["end"], row["reports"], row["detections"]) == (liar, 3, 8, 1, 1)
    assert row["reporters"] == [swarm.client.peer_id.to_base58()] and row["max_difference"] == 0.25
    assert row["kinds"] == ["inference"] and row["last_seen"] <= time.time() and shown["caught_total"] == 1
    assert wait_for(lambda: find(state(swarm.url), PREFIX)["skipped_reports"] >= 1)
    text = get(f"{swarm.url}/metrics")[2].decode()
    assert f'distconf_monitor_caught_by_clients{{model="{PREFIX}",peer="{liar}",blocks="3..7"}} 1' in text
    assert f'distconf_monitor_caught_servers{{model="{PREFIX}"}} 1' in text
    assert "a claim by clients" in text


def test_servers_are_paginated(swarm):
    read_with_all_three(swarm)
    page = find(state(swarm.url, f"?model={PREFIX}&servers_offset=1&servers_limit=1"), PREFIX)
    full = find(state(swarm.url), PREFIX)
    assert page["servers_total"] == 3 and page["servers_offset"] == 1 and page["servers"] == full["servers"][1:2]
    assert state(swarm.url, "?model=no-such-model")["models"] == []
    for bad in ("servers_limit=100000", "servers_offset=-1", "servers_limit=ten"):
        status, _, body = get(f"{swarm.url}/api/v1/state?{bad}")
        assert status == 400 and b"must be an integer" in body


def test_page_assets_are_served_locally_with_a_strict_policy(swarm):
    status, headers, page = get(f"{swarm.url}/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    policy = headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy and "unsafe-inline" not in policy
    refs = re.findall(r'(?:src|href)="([^"]+)"', page.decode())
    assert "/static/monitor.js" in refs and "/static/monitor.css" in refs
    for ref in refs:
        assert ref.startswith("/"), f"the page refers to {ref}, outside the monitor"
        status, _, body = get(f"{swarm.url}{ref}")
        assert status == 200 and body
        text = re.sub(rb'xmlns="[^"]*"', b"", body)  # an XML namespace name, not a resource
        assert not re.search(rb"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text), f"{ref} refers to another host"
    assert get(f"{swarm.url}/static/../app.py")[0] == 404
    assert get(f"{swarm.url}/static/index.html")[0] == 404  # only the listed assets
    schema = json.loads(get(f"{swarm.url}/api/v1/schema")[2])
    assert schema == SwarmStateV1.model_json_schema()


def test_foreign_host_header_is_refused(swarm):
    """A page on another origin cannot read the monitor through DNS rebinding."""
    status, _, _ = get(f"{swarm.url}/api/v1/state", host="evil.example:8000")
    assert status == 400
    assert get(f"{swarm.url}/api/v1/state", host="localhost:8000")[0] == 200


def test_a_server_that_leaves_turns_its_blocks_red(swarm):
    cfg = model(LEAVE_PREFIX, 4)
    d = BlockAnnouncer(swarm.a, cfg, 0, 4, ServerInfo(state=ServerState.ONLINE, throughput=3.0), update_period=30.0)
    d.start()
    announced = time.time()
    announce_blocks(swarm.b, cfg, 2, 4, ServerInfo(state=ServerState.ONLINE, throughput=2.0), expiration=8.0)
    expired = time.time() + 8.0 + 0.5

    def shown_after(moment: float):
        found = find(state(swarm.url), LEAVE_PREFIX)
        return found if found is not None and found["read_at"] > moment else None

    first = wait_for(lambda: (m := shown_after(announced)) and m["online_per_block"] == [1, 1, 2, 2] and m)
    assert first and first["route"]["exists"]
    # a leaving server announces OFFLINE: the first read that starts after that shows it
    d.stop()
    left = time.time()
    after = wait_for(lambda: shown_after(left))
    assert after, "no read of the swarm after the server left"
    assert after["online_per_block"] == [0, 0, 1, 1]
    assert not after["route"]["exists"] and after["route"]["first_gap"] == 0
    assert [s["state"] for s in after["servers"] if s["peer_id"] == swarm.ids["a"]] == ["offline"]
    # a server whose records expire (it stopped refreshing them) disappears the same way
    gone = wait_for(lambda: shown_after(expired), timeout=60.0)
    assert gone, "no read of the swarm after the records expired"
    assert gone["online_per_block"] == [0, 0, 0, 0] and gone["blocks_covered"] == 0
    assert swarm.ids["b"] not in [s["peer_id"] for s in gone["servers"]]


# --------------------------------------------------------------------------- never blocked by the DHT
def _spans_state(prefix: str, num_blocks: int, spans: list[tuple[str, int, int, float]]) -> SwarmState:
    servers = [{} for _ in range(num_blocks)]
    for peer, start, end, rps in spans:
        for i in range(start, end):
            servers[i][peer] = ServerInfo(state=ServerState.ONLINE, throughput=rps, start_block=start, end_block=end)
    return SwarmState(prefix, num_blocks, servers, merge_spans(servers))


def test_requests_never_wait_for_a_slow_read():
    """While a read hangs, the page, the JSON and the metrics answer with the last good snapshot and its age."""
    import threading

    release, reading = threading.Event(), threading.Event()
    first = model_state(_spans_state("slow-hf", 4, [(made_up_peer_id("s"), 0, 4, 1.0)]))

    def reader(previous: Snapshot) -> Snapshot:
        if previous.read_at is None:
            return Snapshot({"slow-hf": first}, time.time())
        reading.set()
        release.wait(60)  # a DHT read that hangs (bounded: the test releases it)
        raise TimeoutError("the DHT did not answer")

    monitor = Monitor(reader, refresh=0.05)
    running = start_in_thread(build_app(monitor))
    try:
        assert reading.wait(30), "the second read never started"
        data = state(running.url)
        assert not release.is_set() and data["refreshing"]
        assert [m["dht_prefix"] for m in data["models"]] == ["slow-hf"] and data["age_seconds"] >= 0
        assert get(f"{running.url}/metrics")[0] == 200 and get(f"{running.url}/")[0] == 200
        release.set()
        failed = wait_for(lambda: (d := state(running.url))["error"] and d, timeout=30)
        assert failed and "TimeoutError" in failed["error"]
        assert [m["dht_prefix"] for m in failed["models"]] == ["slow-hf"]  # the last good data stays
    finally:
        release.set()
        running.stop()


def test_a_state_keeping_family_shows_its_state_next_to_the_kv_figure():
    """A listed hybrid preset: JSON, metrics and page give K/V per token and state per sequence (bfloat16)."""
    from distconf.blocks.sizing import kv_cache_bytes_per_token, state_bytes_per_sequence
    from distconf.loader.auto import load_preset

    repo = "ibm-granite/granite-4.0-h-tiny"
    config = load_preset(repo)
    kv, st = kv_cache_bytes_per_token(config), state_bytes_per_sequence(config)
    assert kv == 2048 and st == 1_599_488  # 4 KV heads x 256 x 2 B; (3328 x 4) x 2 B + 48 x 64 x 128 x 4 B
    hybrid = model_state(_spans_state("hybrid-hf", 40, [(made_up_peer_id("h"), 0, 40, 1.0)]), repository=repo)
    plain = model_state(_spans_state("plain-hf", 4, [(made_up_peer_id("p"), 0, 4, 1.0)]), repository="no/such-model")
    monitor = Monitor(lambda prev: prev, refresh=60)
    monitor.snapshot = Snapshot({"hybrid-hf": hybrid, "plain-hf": plain}, time.time())
    running = start_in_thread(build_app(monitor))
    try:
        data = state(running.url)
        shown = find(data, "hybrid-hf")
        assert (shown["kv_bytes_per_token"], shown["state_bytes_per_sequence"]) == (kv, st)
        assert (shown["kv_blocks"], shown["state_blocks"]) == (4, 36)
        assert find(data, "plain-hf")["state_bytes_per_sequence"] is None  # config unknown: no figure made up
        metrics = get(f"{running.url}/metrics")[2].decode()
        assert f'distconf_monitor_kv_bytes_per_token{{model="hybrid-hf"}} {kv}' in metrics
        assert f'distconf_monitor_state_bytes_per_sequence{{model="hybrid-hf"}} {st}' in metrics
        assert 'state_bytes_per_sequence{model="plain-hf"}' not in metrics
        script = get(f"{running.url}/static/monitor.js")[2].decode()
        assert "state_bytes_per_sequence" in script and "B/sequence/block" in script
    finally:
        running.stop()


@pytest.mark.swarm
def test_a_preset_given_as_model_gets_its_figures_before_any_listing_names_it():
    """``--model PRESET``: the prefix, the block count and the preset, whose figures a read of an empty swarm shows."""
    from distconf.loader.auto import load_preset
    from distconf.monitor.snapshot import read_listing, read_model

    repo = "ibm-granite/granite-4.0-h-tiny"
    config = load_preset(repo)
    prefix, count, preset = cmd_monitor.parse_model(repo)
    assert (prefix, count, preset) == (config.dht_prefix, 40, repo)
    assert cmd_monitor.parse_model("some-prefix:4") == ("some-prefix", 4, None)
    with dht_node() as dht:
        listing = read_listing(dht, {prefix: count}, max_models=8, timeout=10.0, repositories={prefix: preset})
        (wanted,) = listing.models
        assert (wanted.repository, wanted.listed) == (repo, False)
        shown = read_model(dht, wanted, timeout=10.0)
        assert (shown.kv_bytes_per_token, shown.state_bytes_per_sequence) == (2048, 1_599_488)


@pytest.mark.slow  # a few seconds: kept out of make test-fast
def test_a_huge_model_is_paginated():
    """1024 blocks and 3000 spans: the JSON lists one page of servers and counts the rest."""
    spans = [(made_up_peer_id(f"p{i}"), i % 1001, i % 1001 + 24, float(1 + i % 7)) for i in range(3000)]
    monitor = Monitor(lambda prev: prev, refresh=60)
    monitor.snapshot = Snapshot({"huge-hf": model_state(_spans_state("huge-hf", 1024, spans))}, time.time())
    page = state_of(monitor, limit=50)
    shown = page.models[0]
    assert len(shown.servers) == 50 and shown.servers_total == 3000 and len(shown.online_per_block) == 1024
    assert shown.route.exists and shown.route.bottleneck_rps is not None
    assert len(page.model_dump_json()) < 100_000


# --------------------------------------------------------------------------- command line
def test_cli_arguments():
    parser = argparse.ArgumentParser(prog="distconf")
    cmd_monitor.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["monitor", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/x", "--refresh", "500ms",
                              "--model", "_private-hf:12"])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.refresh == 0.5
    assert args.model == [("_private-hf", 12, None)]
    assert [cmd_monitor.parse_duration(t) for t in ("10s", "2m", "1h", "3", "0.5s")] == [10, 120, 3600, 3, 0.5]
    for bad in ("0s", "-1s", "ten", "5 days"):
        with pytest.raises(argparse.ArgumentTypeError):
            cmd_monitor.parse_duration(bad)
    for bad in ("bare-prefix", "a.b:4", "x:0", "x:5000"):
        with pytest.raises(argparse.ArgumentTypeError):
            cmd_monitor.parse_model(bad)
    assert cmd_monitor.run(argparse.Namespace(initial_peers=None, port=8000, max_models=None)) == 2


def test_schema_is_documented():
    """Every field of the versioned schema is described in docs/monitor.md."""
    doc = (REPO / "docs" / "monitor.md").read_text(encoding="utf-8")
    schema = SwarmStateV1.model_json_schema()
    objects = [schema, *schema["$defs"].values()]
    missing = [f"{o['title']}.{name}" for o in objects for name in o["properties"] if f"`{name}`" not in doc]
    assert not missing, f"fields not described in docs/monitor.md: {missing}"
