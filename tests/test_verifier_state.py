"""The client's check state per span (`SpanCheck`) and its reply checks (`reply_checks`), without a swarm."""

from __future__ import annotations

import re

import pytest
import torch
from hivemind.proto import runtime_pb2

from distconf.client.reply_checks import BadReply, checked_reply, max_reply_bytes
from distconf.client.verifier import SpanCheck
from distconf.rpc.protocol import serialize_tensors


def _outputs(first: int, n: int, batch: int = 2) -> torch.Tensor:
    """Outputs whose values name their row and position (row * 100 + position)."""
    rows = torch.arange(batch).view(batch, 1, 1) * 100.0
    return (rows + torch.arange(first, first + n).view(1, n, 1)).expand(batch, n, 3).clone()


def test_outputs_since_the_last_check_are_held_in_order() -> None:
    check = SpanCheck()
    check.record(0, _outputs(0, 4), None, "a")  # a prefill
    check.record(4, _outputs(4, 1), None, "a")
    check.record(5, _outputs(5, 2), None, "a")
    assert torch.equal(check.unverified(0, 7), _outputs(0, 7))
    assert torch.equal(check.unverified(3, 6), _outputs(3, 3))
    assert check.unverified(0, 8) is None  # position 7 was never answered
    check.passed(5)
    assert check.verified == 5
    assert check.unverified(0, 7) is None and torch.equal(check.unverified(5, 7), _outputs(5, 2))


def test_a_replay_overwrites_and_a_rewind_forgets() -> None:
    check = SpanCheck()
    check.record(0, _outputs(0, 6), None, "a")
    check.rewind(3)
    assert check.unverified(0, 4) is None and torch.equal(check.unverified(0, 3), _outputs(0, 3))
    check.record(3, _outputs(3, 2) + 0.5, None, "a")  # the positions again, other values
    assert torch.equal(check.unverified(3, 5), _outputs(3, 2) + 0.5)
    check.passed(5)
    check.rewind(2)
    assert check.verified == 2  # a verified position that is rewound must be checked again


def test_a_replacement_server_does_not_overwrite_the_results_the_next_spans_got() -> None:
    check = SpanCheck()
    check.record(0, _outputs(0, 4), None, "old")
    check.passed(2)
    fresh = SpanCheck()
    fresh.inherit(check, "new")
    fresh.record(0, _outputs(0, 5) + 0.5, None, "new")  # the replay of positions 0..3, then position 4
    assert fresh.verified == 2
    assert torch.equal(fresh.unverified(2, 4), _outputs(2, 2))  # the old server's results stay
    assert torch.equal(fresh.unverified(4, 5), _outputs(4, 1) + 0.5)
    assert (fresh.owner(3), fresh.owner(4), fresh.owner(1)) == ("old", "new", None)


def test_hypo_ids_reorder_the_rows_held_and_compose_for_the_shadow() -> None:
    check = SpanCheck()
    check.record(0, _outputs(0, 2, batch=3), None, "a")
    first = torch.tensor([2, 0, 1])
    check.record(2, _outputs(2, 1, batch=3), first, "a")
    assert torch.equal(check.unverified(0, 2), _outputs(0, 2, batch=3)[first])
    second = torch.tensor([1, 1, 0])
    check.record(3, _outputs(3, 1, batch=3), second, "a")
    assert torch.equal(check.unverified(0, 2), _outputs(0, 2, batch=3)[first][second])
    assert torch.equal(check.perm, first[second])  # what the shadow's cache must be reordered by


def _proto(tensor: torch.Tensor, **changes: object) -> runtime_pb2.Tensor:
    proto = serialize_tensors([tensor])[0]
    for name, value in changes.items():
        if name == "size":
            del proto.size[:]
            proto.size.extend(value)  # type: ignore[arg-type]
        else:
            setattr(proto, name, value)
    return proto


def test_a_good_reply_is_decoded() -> None:
    x = torch.randn(2, 3, 8)
    assert torch.equal(checked_reply([_proto(x)], x.shape, "server"), x)
    bf = x.to(torch.bfloat16)
    assert torch.equal(checked_reply([_proto(bf)], x.shape, "server"), bf)


@pytest.mark.parametrize(("changes", "reason"), [
    ({"dtype": "complex128"}, "dtype 'complex128'"),
    ({"dtype": "int64"}, "dtype 'int64'"),
    ({"size": [2, 3, 9]}, "shape [2, 3, 9]"),
    ({"buffer": b"\0" * 10}, "10 bytes"),
])
def test_a_mistyped_or_missized_reply_is_refused_before_decoding(changes: dict[str, object], reason: str) -> None:
    x = torch.randn(2, 3, 8)
    with pytest.raises(BadReply, match=re.escape(reason)):
        checked_reply([_proto(x, **changes)], x.shape, "server")


def test_a_non_finite_or_empty_reply_is_a_server_failure() -> None:
    x = torch.randn(2, 3, 8)
    x[1, 2, 5] = float("nan")
    with pytest.raises(BadReply, match="non-finite"):
        checked_reply([_proto(x)], x.shape, "server")
    with pytest.raises(BadReply, match="no tensor"):
        checked_reply([], x.shape, "server")
    assert issubclass(BadReply, ConnectionError)  # the client's failover treats it as a failed server


def test_the_reply_size_cap_fits_a_float32_reply() -> None:
    x = torch.randn(2, 3, 8)
    request = runtime_pb2.ExpertResponse(tensors=[_proto(x)])
    assert len(request.SerializeToString()) <= max_reply_bytes(x.shape) < len(request.SerializeToString()) + 70_000
