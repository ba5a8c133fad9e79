"""The swarm heals itself (Petals' ``--balance_quality``): the pure decision, and three real servers.

Unit tests feed `decide_rebalance` hand-made records: the hole, nothing better, a gain too
small or big enough for the quality threshold, a move that would cut the chain. The swarm
test starts three ``distconf serve`` processes of a 4-block model placed by the swarm
(``--num-blocks 2``: two share one half), stops the one alone on its half, and checks that
one of the two others moves there by itself and that a client's next generation equals the
local model's.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from dhthelpers import wait_until

from distconf.dht.records import ServerInfo, ServerState
from distconf.server.rebalance import decide_rebalance, swarm_spans

ONLINE, JOINING, OFFLINE = ServerState.ONLINE, ServerState.JOINING, ServerState.OFFLINE
CHECK_PERIOD = 2.0
"""Mean seconds between the swarm test's balance checks."""
PEERS = {"A": "12D3KooWA", "B": "12D3KooWB", "C": "12D3KooWC"}


def records(num_blocks: int, *spans: tuple[str, int, int, float, ServerState]) -> list[dict[str, ServerInfo]]:
    """Per-block records of ``(peer, start, end, throughput, state)`` spans."""
    servers: list[dict[str, ServerInfo]] = [{} for _ in range(num_blocks)]
    for peer, start, end, throughput, state in spans:
        info = ServerInfo(state=state, throughput=throughput, start_block=start, end_block=end)
        for block in range(start, end):
            servers[block][PEERS[peer]] = info
    return servers


def decide(peer: str, servers: list[dict[str, ServerInfo]], quality: float = 0.75) -> Any:
    return decide_rebalance(PEERS[peer], servers, quality, rng=random.Random(0))


# ------------------------------------------------------------------ the decision


def test_spans_and_throughputs_count_joining_not_offline() -> None:
    servers = records(4, ("A", 0, 2, 1.0, ONLINE), ("B", 2, 4, 2.0, JOINING), ("C", 0, 4, 5.0, OFFLINE))
    spans, totals = swarm_spans(servers)
    assert totals == [1.0, 1.0, 2.0, 2.0]
    assert sorted(spans) == [PEERS["A"], PEERS["B"]]
    assert (spans[PEERS["B"]].start, spans[PEERS["B"]].end) == (2, 4)


def test_hole_is_filled() -> None:
    # A left (OFFLINE): blocks 0..1 have no server; B and C both hold 2..3
    servers = records(4, ("A", 0, 2, 10.0, OFFLINE), ("B", 2, 4, 10.0, ONLINE), ("C", 2, 4, 12.0, ONLINE))
    for peer in ("B", "C"):
        d = decide(peer, servers)
        assert d.move and d.start == 0, d
        assert d.old_throughput == 0.0 and d.new_throughput and d.new_throughput >= 10.0
        assert d.quality == 0.0


def test_hole_in_the_middle_of_six_blocks() -> None:
    # 0..1 held twice, 2..3 held by nobody (its server left), 4..5 once
    servers = records(6, ("A", 0, 2, 10.0, ONLINE), ("B", 0, 2, 10.0, ONLINE), ("C", 2, 4, 10.0, OFFLINE),
                      ("C", 4, 6, 10.0, ONLINE))
    assert decide("B", servers).start == 2 and decide("B", servers).move
    assert decide("A", servers).start == 2 and decide("A", servers).move
    assert decide("C", servers).reason == "this server is at its best place already"


def test_nothing_better() -> None:
    servers = records(4, ("A", 0, 2, 10.0, ONLINE), ("B", 2, 4, 10.0, ONLINE), ("C", 2, 4, 10.0, ONLINE))
    assert decide("C", servers).reason == "this server is at its best place already"
    assert decide("A", servers).reason == "leaving would cut the swarm's chain"
    alone = records(4, ("A", 0, 2, 10.0, ONLINE), ("B", 2, 4, 10.0, ONLINE))  # no move can help a 2-server chain
    assert not decide("A", alone).move and not decide("B", alone).move


def test_hole_already_being_filled_by_a_joining_server() -> None:
    # C announced 0..1 JOINING with its throughput (as a moving server does): B stays
    servers = records(4, ("A", 0, 2, 10.0, OFFLINE), ("B", 2, 4, 10.0, ONLINE), ("C", 0, 2, 12.0, JOINING))
    assert not decide("B", servers).move


def test_quality_threshold_follows_petals() -> None:
    # swarm throughput 8 now; C moving to 0..1 makes it 10: quality 0.8
    servers = records(4, ("A", 0, 2, 8.0, ONLINE), ("B", 2, 4, 10.0, ONLINE), ("C", 2, 4, 10.0, ONLINE))
    small = decide("C", servers, 0.75)
    assert not small.move and small.quality == pytest.approx(0.8, abs=0.01)
    assert decide("C", servers, 0.9).move
    # quality 0.1: moves with the default threshold
    weak = records(4, ("A", 0, 2, 1.0, ONLINE), ("B", 2, 4, 10.0, ONLINE), ("C", 2, 4, 10.0, ONLINE))
    d = decide("C", weak)
    assert d.move and d.start == 0 and d.quality == pytest.approx(0.1, abs=0.01)


def test_disabled_forced_and_absent() -> None:
    weak = records(4, ("A", 0, 2, 1.0, ONLINE), ("B", 2, 4, 10.0, ONLINE), ("C", 2, 4, 10.0, ONLINE))
    assert not decide("C", weak, 0.0).move
    balanced = records(4, ("A", 0, 2, 9.0, ONLINE), ("B", 2, 4, 10.0, ONLINE), ("C", 2, 4, 10.0, ONLINE))
    assert not decide("C", balanced, 0.75).move
    forced = decide("C", balanced, 1.5)
    assert forced.move and forced.start == 0
    assert not decide_rebalance("12D3KooWnobody", balanced, 0.75).move


# ------------------------------------------------------------------ three real servers


def _layout(dht: Any, config: Any) -> dict[str, tuple[int, int, ServerState]]:
    """``{peer: (start, end, state)}`` of every non-OFFLINE span the DHT holds."""
    from distconf.dht import find_block_servers

    state = find_block_servers(dht, config, timeout=20.0)
    return {s.peer_id: (s.start, s.end, s.state) for s in state.spans if s.state != OFFLINE}


def _wait_layout(dht: Any, config: Any, ok: Any, deadline: float, what: str) -> dict[str, Any]:
    layout = wait_until(lambda: _layout(dht, config), ok, timeout=max(0.0, deadline - time.monotonic()),
                        interval=0.25)
    if ok(layout):
        return layout
    raise TimeoutError(f"{what}: not within the deadline; last layout {layout}")


def _covers(layout: dict[str, Any], num_blocks: int, peers: set[str]) -> bool:
    online = [(a, b) for p, (a, b, s) in layout.items() if s == ONLINE and p in peers]
    return all(any(a <= i < b for a, b in online) for i in range(num_blocks))


@pytest.mark.swarm
def test_swarm_heals_a_hole(tmp_path: Path) -> None:
    from client_swarm import prompts
    from swarm_harness import Swarm

    with Swarm(tmp_path, "llama", layers=4) as swarm:
        model_dir, local, config, dht = swarm.model_dir, swarm.local, swarm.config, swarm.dht
        # one after the other, placed by the swarm (--num-blocks: a span given with --blocks never moves)
        for i in range(3):
            server = swarm.start_server(model_dir, None, "--num-blocks", "2", "--balance-quality", "0.75",
                                        "--mean-balance-check-period", str(CHECK_PERIOD), log=f"server-{i}.log",
                                        name=f"server-{i}")
            swarm.wait_ready([server], timeout=120)
        by_peer = {s.peer_id: s for s in swarm.servers}
        layout = _wait_layout(dht, config, lambda lay: len(lay) == 3 and _covers(lay, 4, set(by_peer)),
                              time.monotonic() + 60, "three servers ONLINE")
        ids = prompts(batch=1, length=5, seed=3)
        with torch.no_grad():
            expected = local.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0,
                                      max_new_tokens=6).tolist()
        # default ban policy; retries bounded (the default retries forever) but enough to outlast one ban:
        # the client's stale view may first send the mover its old span, be refused and ban it for 15 s
        model = swarm.model(max_retries=40, min_backoff=0.1, max_backoff=1.0)
        with torch.no_grad():
            assert model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0,
                                  max_new_tokens=6).tolist() == expected

        alone = [p for p, (a, b, _) in layout.items()
                 if sum(1 for q, (c, d, _) in layout.items() if (c, d) == (a, b)) == 1]
        assert len(alone) == 1, layout
        victim = alone[0]
        hole = layout[victim][:2]
        others = set(by_peer) - {victim}
        t0 = time.monotonic()
        by_peer[victim].stop()  # SIGTERM: it announces OFFLINE
        healed = _wait_layout(dht, config, lambda lay: victim not in lay and _covers(lay, 4, others),
                              time.monotonic() + 60, f"a server moving into the hole {hole}")
        took = time.monotonic() - t0
        movers = [p for p in others if healed[p][:2] == hole]
        assert movers, healed
        assert any("moving from blocks" in by_peer[p].log_tail(200_000) for p in movers)

        t1 = time.monotonic()
        with torch.no_grad():  # the same client, no manual step
            out = model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, max_new_tokens=6)
        assert out.tolist() == expected
        print(f"hole {hole} filled {took:.1f} s after the stop by {[p[-6:] for p in movers]}; "
              f"next generation took {time.monotonic() - t1:.1f} s")


def test_serve_options_carry_the_balance_settings() -> None:
    import argparse

    from distconf.cli.cmd_serve import _options, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    defaults = _options(parser.parse_args(["serve", "m", "--new-swarm"]), [])
    assert (defaults.balance_quality, defaults.mean_balance_check_period) == (0.75, 60.0)  # Petals' defaults
    given = _options(parser.parse_args(["serve", "m", "--new-swarm", "--balance-quality", "0",
                                        "--mean-balance-check-period", "3"]), [])
    assert (given.balance_quality, given.mean_balance_check_period) == (0.0, 3.0)


def test_a_replaced_handler_refuses_the_steps_of_its_open_sessions() -> None:
    import asyncio

    from distconf.server.span_moves import _ranges, _RetiredCompute
    from distconf.server.validation import RequestError

    assert _ranges([5, 0, 1, 3, 4]) == [(0, 2), (3, 6)] and _ranges([]) == []
    with pytest.raises(RequestError, match=r"moved from blocks 2\.\.3"):
        asyncio.run(_RetiredCompute("this server moved from blocks 2..3 to 0..1").run(print))
