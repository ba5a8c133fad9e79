"""Clients' reports of caught servers on a real DHT (127.0.0.1 only): published, read, garbage dropped alone.

One module-scoped swarm: a bootstrap node and a server started by distconf (guarded), a
plain hivemind node that stores whatever it is sent, a plain attacker, a client that
publishes (`ReportPublisher`, the verifier listener the CLI registers) and a reader (the
monitor's kind of node). Every wait is bounded.
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
from dhthelpers import stand_in_config, wait_for
from swarm_harness import Swarm
from test_dht_hostile import deep_tuple, local_subkeys, made_up_peer_id, store_raw

from distconf.client.verify_events import VerificationEvent
from distconf.dht import ServerInfo, ServerState, announce_blocks, find_block_servers
from distconf.dht.report_records import MAX_CAUGHT, ClientReport, report_problem
from distconf.dht.reports import ReportPublisher, read_reports
from distconf.loader.naming import block_uid, reports_key

pytestmark = pytest.mark.swarm

PREFIX = "reports-test-hf"
NUM_BLOCKS = 6
TTL = 600.0
CULPRIT = made_up_peer_id("the-liar")


def event(peer: str = CULPRIT, start: int = 2, end: int = 4, difference: float = 0.5, **kw) -> VerificationEvent:
    """A detection as the client's verifier records it."""
    return VerificationEvent(peer_id=peer, start=start, end=end, step=3, position=7, difference=difference,
                             tolerance=0.01, checkers=(made_up_peer_id("honest"),), **kw)


def entry(**over) -> dict:
    """A valid report entry, with ``over`` replacing fields."""
    base = {"peer_id": CULPRIT, "start": 0, "end": 2, "difference": 1.5, "kind": "inference", "count": 1,
            "when": time.time()}
    return {**base, **over}


@pytest.fixture(scope="module")
def swarm():
    with Swarm() as s:
        boot = s.dht
        server = s.node()
        petals, attacker = s.plain_node(), s.plain_node()
        client, reader = s.node(client_mode=True), s.node(client_mode=True)
        cfg = stand_in_config(PREFIX, NUM_BLOCKS)
        announce_blocks(server, cfg, 0, NUM_BLOCKS, ServerInfo(state=ServerState.ONLINE, throughput=3.0),
                        expiration=TTL)
        yield SimpleNamespace(boot=boot, server=server, petals=petals, attacker=attacker, client=client,
                              reader=reader, cfg=cfg, client_id=client.peer_id.to_base58())


def test_the_reports_key_is_never_a_block_uid():
    assert reports_key(PREFIX) == f"{PREFIX}.reports"
    assert reports_key(PREFIX) not in {block_uid(PREFIX, i) for i in range(NUM_BLOCKS)}
    with pytest.raises(ValueError):
        reports_key("bad prefix")


def test_report_records_are_parsed_strictly():
    assert report_problem({"caught": [entry()]}) is None
    assert report_problem({"caught": [entry(difference=math.inf)]}) is None  # non-finite results
    bad = {
        "empty": {"caught": []}, "list": [entry()], "made-up peer": {"caught": [entry(peer_id="junk")]},
        "inverted": {"caught": [entry(start=3, end=1)]}, "nan": {"caught": [entry(difference=math.nan)]},
        "negative": {"caught": [entry(difference=-1.0)]}, "future": {"caught": [entry(when=time.time() + 1e6)]},
        "too many": {"caught": [entry(start=i, end=i + 1) for i in range(MAX_CAUGHT + 1)]},
        "string count": {"caught": [entry(count="3")]}, "no caught": {"culprit": CULPRIT},
        "kind": {"caught": [entry(kind="<script>")]},
    }
    for name, value in bad.items():
        assert report_problem(value) is not None, name


def test_a_published_report_is_read_by_another_node(swarm):
    publisher = ReportPublisher(swarm.client, PREFIX, NUM_BLOCKS)
    publisher(event())
    publisher(event(difference=2.0))  # the same server and span again: counted, the larger difference kept
    publisher(event(peer=made_up_peer_id("another-liar"), start=0, end=1, difference=math.inf, kind="forward"))
    assert publisher.flush(30.0)

    def published():
        read = read_reports(swarm.reader, PREFIX, num_blocks=NUM_BLOCKS, timeout=20)
        report = read.reports.get(swarm.client_id)
        return report if report is not None and len(report.caught) == 2 else None

    report = wait_for(published, timeout=30)
    assert report, "the client's report never reached the reader"
    first, second = report.caught
    assert (first.peer_id, first.start, first.end, first.count, first.difference) == (CULPRIT, 2, 4, 2, 2.0)
    assert second.difference == math.inf and second.kind == "forward"
    assert publisher.published >= 1 and publisher.failed == 0


def test_garbage_reports_are_dropped_alone(swarm):
    key = reports_key(PREFIX)
    honest = made_up_peer_id("honest-reporter")
    items = [(key, honest, {"caught": [entry(peer_id=CULPRIT)]}, TTL)]
    garbage = {
        made_up_peer_id("g1"): {"caught": [entry(peer_id="junk")]},
        made_up_peer_id("g2"): {"caught": [entry(difference=math.nan)]},
        made_up_peer_id("g3"): {1: 2},
        made_up_peer_id("g4"): deep_tuple(300),
        made_up_peer_id("g5"): {"caught": [entry(start=i, end=i + 1) for i in range(MAX_CAUGHT + 1)]},
        made_up_peer_id("g6"): {"caught": [entry()], "pad": "x" * 4000},
        "not-a-peer-id": {"caught": [entry()]},
    }
    server_record = made_up_peer_id("g7")  # a server record where reports belong
    items += [(key, sub, value, TTL) for sub, value in [*garbage.items(), (server_record, (2, 1.0, {}))]]
    store_raw(swarm.attacker, items)
    assert len(local_subkeys(swarm.petals, key) or []) > len(garbage)  # the unguarded node keeps it all
    for node in (swarm.boot, swarm.server):
        kept = set(local_subkeys(node, key) or [])
        assert honest in kept and not kept & set(garbage), kept
    # a node that never met the model cannot tell its reports key from a block key (keys arrive hashed):
    # it takes the server record; the server, which registered the model, holds the key to reports
    assert server_record in local_subkeys(swarm.boot, key)
    assert server_record not in local_subkeys(swarm.server, key)
    read = wait_for(lambda: (r := read_reports(swarm.reader, PREFIX, num_blocks=NUM_BLOCKS, timeout=20))
                    .reports.get(honest) and r, timeout=30)
    assert read, "the honest report was hidden by the garbage"
    assert not set(read.reports) & {*garbage, server_record}
    assert server_record in read.skipped  # the reader skips what is not a report
    assert ClientReport.from_wire(read.reports[honest].to_wire()) == read.reports[honest]


def test_a_report_under_a_block_key_hides_no_server(swarm):
    """A report-shaped dict under a block key passes a node that cannot tell keys apart, and is skipped there."""
    store_raw(swarm.attacker, [(block_uid(PREFIX, 1), made_up_peer_id("r"), {"caught": [entry()]}, TTL)])
    state = find_block_servers(swarm.reader, swarm.cfg, timeout=30)
    assert all(swarm.server.peer_id.to_base58() in block for block in state.servers)
    # the server registered the model: it holds each of its keys to its own kind
    assert local_subkeys(swarm.server, block_uid(PREFIX, 1)) == [swarm.server.peer_id.to_base58()]
