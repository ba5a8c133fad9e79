"""Speculative decoding through the swarm: transformers' assisted generation gives plain greedy generation's tokens.

Two tiny llama servers (0:2, 2:4). transformers checks several proposed tokens in one step and crops the rejected
ones from the cache (`RemoteCache.crop`: the servers rewind); with ``prompt_lookup_num_tokens`` (n-gram matches
in the context) and with ``assistant_model`` (a local draft model keeping its own cache), the tokens equal plain
greedy generation's, through the swarm and locally.
"""

from __future__ import annotations

import pytest
import torch
from client_swarm import make_model_dir
from swarm_harness import Swarm

pytestmark = pytest.mark.swarm

REPEATING = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]])  # n-gram matches for prompt lookup to propose


@pytest.fixture(scope="module")
def swarm_parts(tmp_path_factory):
    with Swarm(tmp_path_factory.mktemp("speculative"), "llama", ("0:2", "2:4"), noise=0.05) as s:
        yield s.model(), s.local, s.model_dir, s.dht, s.servers


@pytest.fixture(scope="module")
def swarm(swarm_parts):
    return swarm_parts[:2]


def generate(model, ids, **kwargs) -> list[int]:
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                             pad_token_id=0, **kwargs)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("ids", [REPEATING, torch.tensor([[3, 17, 41, 2, 99, 23, 7, 64]])], ids=["repeating", "plain"])
def test_prompt_lookup_through_the_swarm_gives_plain_greedy_tokens(swarm, ids):
    model, local = swarm
    plain = generate(local, ids)
    assert generate(model, ids) == plain
    assert generate(model, ids, prompt_lookup_num_tokens=4) == plain


def test_a_local_draft_model_through_the_swarm_gives_plain_greedy_tokens(swarm):
    model, local = swarm
    assert generate(model, REPEATING, assistant_model=local) == generate(local, REPEATING)


# ----------------------------------------------------------------------------- distconf's own speculative streams
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]


def stream_tokens(model, sampling, speculation=None) -> list[int]:
    from distconf.client.textgen import stream_text

    return [piece.token_id for piece in stream_text(model, None, PROMPT, sampling, speculation)]


@pytest.mark.parametrize("source", ["lookup", "draft"])
def test_speculative_streams_give_plain_greedy_tokens(swarm, source):
    from distconf.client.speculative import DraftModel, PromptLookup, Speculation
    from distconf.client.textgen import Sampling

    model, local = swarm
    greedy = Sampling(max_tokens=24, temperature=0)
    speculation = Speculation(PromptLookup() if source == "lookup" else DraftModel(local))
    assert stream_tokens(model, greedy, speculation) == stream_tokens(model, greedy)
    assert speculation.controller.rounds > 0 and speculation.controller.accepted > 0


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A draft that differs from the target (another random model of the same family)."""
    _, draft = make_model_dir(tmp_path_factory.mktemp("draft") / "llama", "llama", noise=0.05, seed=1)
    return draft


def sampled_pairs(model, draft, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    from distconf.client.speculative import DraftModel, Speculation, SpeculationController
    from distconf.client.textgen import Sampling

    vocab = model.config.vocab_size
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for seed in range(samples):
        sampling = Sampling(max_tokens=2, temperature=1.0, top_k=4, seed=seed)
        # measurements that make two proposals worth it from the first step (the prompt's)
        controller = SpeculationController(max_tokens=2, step_seconds={1: 0.05}, draft_seconds=0.001)
        speculation = Speculation(DraftModel(draft), controller)
        t1, t2 = stream_tokens(model, sampling, speculation)
        first[t1] += 1
        second[t2] += 1
    return first, second


def exact_marginals(local) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-4 sampling distribution of the first token, and of the second (summed over the first)."""
    def top4(logits: torch.Tensor) -> torch.Tensor:
        kept = logits.masked_fill(logits < logits.topk(4).values[-1], float("-inf"))
        return torch.softmax(kept, -1)

    with torch.no_grad():
        p1 = top4(local(torch.tensor([PROMPT])).logits[0, -1])
        p2 = torch.zeros_like(p1)
        for t1 in p1.nonzero().flatten().tolist():
            p2 += p1[t1] * top4(local(torch.tensor([[*PROMPT, t1]])).logits[0, -1])
    return p1, p2


def chi_square_over(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Chi-square of ``counts`` against ``probs`` over the tokens of nonzero probability (and the degrees of freedom);
    a count where ``probs`` is 0 makes it infinite."""
    if float(counts[probs == 0].sum()) > 0:
        return float("inf"), 0
    support = probs > 0
    expected = probs[support] * counts.sum()
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88, 10: 29.59,
            11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70}  # chi-square at p = 0.001 by degrees of freedom


@pytest.mark.slow
def test_speculative_sampling_through_the_swarm_keeps_the_targets_distribution(swarm, other_draft, monkeypatch):
    """The first two sampled tokens (top-k 4, temperature 1; the draft another random model): their frequencies
    over 400 seeds match the target's own distributions; a rule keeping every draft token fails the same test.

    400 seeds keep every expected count above 20 (the chi-square approximation holds); the
    wrong rule's first tokens fall outside the target's top 4 (an infinite statistic), so 50 seeds show it."""
    from distconf.client import textgen

    model, local = swarm
    p1, p2 = exact_marginals(local)
    first, second = sampled_pairs(model, other_draft, 400)
    for counts, probs in ((first, p1), (second, p2)):
        statistic, dof = chi_square_over(counts, probs)
        assert statistic < CRITICAL.get(dof, 40.0), (statistic, dof, counts[probs > 0].tolist())
    monkeypatch.setattr(textgen, "accept", lambda proposal, logits, *_: (len(proposal.tokens), 0, logits[-1]))
    wrong_first, _ = sampled_pairs(model, other_draft, 50)
    statistic, dof = chi_square_over(wrong_first, p1)
    assert statistic > CRITICAL.get(dof, 40.0), (statistic, wrong_first[p1 > 0].tolist())


# ----------------------------------------------------------------------------- speculation with the rest of the swarm
@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """A second swarm: two servers of each span (0:2, 2:4): a spare for failover, and an independent checker."""
    with Swarm(tmp_path_factory.mktemp("speculative-three"), "llama", ("0:2", "2:4", "2:4", "0:2"),
               noise=0.05) as s:
        yield s.model, s.local, s.servers


def test_concurrent_speculative_sessions_are_batched_and_exact(three):
    """Four speculative streams at once (prompt lookup) and one plain one: each gives plain greedy's tokens, and
    the servers computed rows of several sessions together."""
    import threading

    from client_swarm import server_info

    from distconf.client.speculative import PromptLookup, Speculation
    from distconf.client.textgen import Sampling

    make, _, servers = three
    model = make()
    greedy = Sampling(max_tokens=20, temperature=0)
    expected = stream_tokens(model, greedy)
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i] = stream_tokens(model, greedy, Speculation(PromptLookup()) if i < 4 else None)

    def batched_rows() -> int:  # the sessions spread over two servers per span: any of them may batch
        return sum(int(server_info(model, s.peer_id)["stats"].get("batched_rows", 0)) for s in servers)

    for _ in range(5):  # batches form when steps queue up behind a busy server: a matter of timing
        threads = [threading.Thread(target=run, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [results[i] for i in range(5)] == [expected] * 5
        if batched_rows() > 0:
            break
    assert batched_rows() > 0


def test_spot_checks_cover_speculative_steps(three):
    """With verify_fraction=1 every scored step is checked by another server, and nothing is caught."""
    from distconf.client.speculative import PromptLookup, Speculation
    from distconf.client.textgen import Sampling

    make, _, servers = three
    alive = [s for s in servers if s.alive]
    model = make(verify_fraction=1.0)
    greedy = Sampling(max_tokens=16, temperature=0)
    speculation = Speculation(PromptLookup())
    assert len([s for s in alive if s.span == (2, 4)]) == 2  # (the failover test, which kills one, runs after)
    assert len([s for s in alive if s.span == (0, 2)]) == 2
    assert stream_tokens(model, greedy, speculation) == stream_tokens(make(), greedy)
    assert speculation.controller.rounds > 0
    assert model.verification_events == []


def test_a_failover_mid_speculation_keeps_the_tokens(three):
    """The server of the last span is killed five tokens into a speculative stream: the session replays its
    history (proposals rolled back included) to the spare, and the tokens are plain greedy's."""
    from distconf.client.speculative import DraftModel, Speculation
    from distconf.client.textgen import Sampling, stream_text

    make, local, servers = three
    model = make(ban_timeout=600.0, min_backoff=0.05)
    greedy = Sampling(max_tokens=24, temperature=0)
    expected = stream_tokens(model, greedy)
    by_peer = {s.peer_id: s for s in servers}
    stream = stream_text(model, None, PROMPT, greedy, Speculation(DraftModel(local)))
    tokens, killed = [], []
    for piece in stream:
        tokens.append(piece.token_id)
        if len(tokens) >= 5 and not killed:
            victim = stream._cache.session.sessions[-1].peer_id
            by_peer[victim].kill()
            killed.append(victim)
    assert killed and tokens == expected


def test_several_rows_of_assisted_generation_each_keep_their_own_accepted_length(swarm):
    """transformers' assisted generation takes one row; the client runs each row on a session of its own, at once."""
    model, local = swarm
    ids = torch.cat([REPEATING, torch.tensor([[3, 17, 41, 2, 99, 23, 7, 64, 5, 6, 7, 8]])])
    expected = torch.cat([torch.tensor([generate(local, ids[i:i + 1])]) for i in range(2)])
    for kwargs in ({"prompt_lookup_num_tokens": 4}, {"assistant_model": local}):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                 pad_token_id=0, **kwargs)
        assert out[:, ids.shape[1]:].tolist() == expected.tolist()


@pytest.mark.parametrize("mode", ["ptune", "deep_ptune"])
def test_speculation_with_trained_prompts_gives_plain_greedy_tokens(swarm_parts, mode):
    """A prompt-tuned model (input prompts, or deep prompts the servers add in every block) speculates exactly: the
    rewinds never reach the prompt positions, and the scored steps carry the prompts as plain steps do."""
    from distconf.client import AutoDistributedModelForCausalLM
    from distconf.client.speculative import DraftModel, PromptLookup, Speculation
    from distconf.client.textgen import Sampling

    model, local, model_dir, dht, _ = swarm_parts
    tuned = AutoDistributedModelForCausalLM.from_pretrained(model_dir, dht=dht, max_retries=3, tuning_mode=mode,
                                                            pre_seq_len=3)
    try:
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in tuned.prompts.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
        greedy = Sampling(max_tokens=16, temperature=0)
        plain = stream_tokens(tuned, greedy)
        assert plain != stream_tokens(model, greedy)  # the prompts change the answer
        for source in (PromptLookup(), DraftModel(local)):
            speculation = Speculation(source)
            assert stream_tokens(tuned, greedy, speculation) == plain, source
            assert speculation.controller.rounds > 0
    finally:
        tuned.shutdown()


def test_a_scored_step_is_one_message_per_hop(swarm_parts):
    """k proposed tokens are scored in one step: each server receives one message per round, not one per token."""
    from client_swarm import server_info

    from distconf.client.speculative import DraftModel, Speculation, SpeculationController
    from distconf.client.textgen import Sampling

    model, local, _, _, servers = swarm_parts

    def steps() -> list[int]:
        stats = [server_info(model, s.peer_id)["stats"] for s in servers]
        return [int(st.get("steps", 0)) + int(st.get("pushed_steps", 0)) for st in stats]

    before = steps()
    # the same weights: every proposal is kept; margin 0: speculate whatever the machine's load makes steps cost
    speculation = Speculation(DraftModel(local), SpeculationController(margin=0.0))
    tokens = stream_tokens(model, Sampling(max_tokens=24, temperature=0), speculation)
    sent = [after - b for after, b in zip(steps(), before)]
    assert len(tokens) == 24 and speculation.controller.accepted >= 6
    assert sent[0] == sent[1] and sent[0] <= 24 - speculation.controller.accepted + 1, (sent, speculation.controller)
