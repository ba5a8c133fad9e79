"""Prompt tuning through a real swarm: gradients, training, generation, failover, saving.

Three ``distconf serve`` processes hold a tiny llama model (4 blocks, float32): server A
blocks 0:2, servers B and C blocks 2:4 (the failover test kills one of them). The local
reference is the same transformers model run in this process with autograd: the input
prompts go in front of the input embeddings (llama's embedding stage is the identity, so
that is the first block's input) and the deep prompts are added to the first positions of
each decoder layer's input by hooks.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import forkserver
import pytest
import torch
from swarm_harness import Swarm as HarnessSwarm
from swarm_harness import swarm_fixture

from distconf.tools.serving import stop_all

PRE = 3
BATCH = 2


class Swarm(HarnessSwarm):
    """The harness's swarm: a tiny llama folder, its local model and three servers (0:2, 2:4, 2:4)."""

    def __init__(self, root: Path, *args: Any, **kwargs: Any) -> None:
        super().__init__(root, *args, **kwargs)
        self.local.requires_grad_(False)
        self.killed: set[str] = set()

    def model(self, directory: Path | None = None, **kwargs: Any) -> Any:
        return super().model(directory, max_retries=2, **kwargs)


swarm = swarm_fixture("ptune-swarm", "llama", ("0:2", "2:4", "2:4"), ("--verify-weights",), cls=Swarm, noise=0.1)


def ids(seed: int = 0, length: int = 5, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, length), generator=torch.Generator().manual_seed(seed))


def randomize(prompts: Any, seed: int = 1) -> None:
    """Non-trivial prompt values (deep prompts start at zero otherwise)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in prompts.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)


def local_logits(local: Any, input_ids: torch.Tensor, prompt: torch.Tensor, deep: torch.Tensor | None
                 ) -> torch.Tensor:
    """The reference: the local model with the prompts, prompt positions cut from the logits."""
    pre = prompt.shape[0]
    layers = local.model.layers
    handles = []
    if deep is not None:
        for i, layer in enumerate(layers):
            def add(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], i: int = i) -> Any:
                hidden = args[0] if args else kwargs["hidden_states"]
                pad = torch.zeros_like(hidden[:, pre:])
                hidden = hidden + torch.cat([deep[i].expand(hidden.shape[0], -1, -1), pad], dim=1)
                return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})
            handles.append(layer.register_forward_pre_hook(add, with_kwargs=True))
    try:
        embeds = local.get_input_embeddings()(input_ids)
        embeds = torch.cat([prompt.unsqueeze(0).expand(input_ids.shape[0], -1, -1), embeds], dim=1)
        logits = local(inputs_embeds=embeds, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    return logits[:, pre:]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("mode", ["ptune", "deep_ptune"])
def test_prompt_gradients_equal_local_autograd(swarm: Swarm, mode: str) -> None:
    model = swarm.model(tuning_mode=mode, pre_seq_len=PRE)
    prompts = model.prompts
    randomize(prompts)
    x = ids(0)
    weights = torch.randn(BATCH, x.shape[1], model.config.vocab_size, generator=torch.Generator().manual_seed(3))

    logits = model(x, use_cache=False).logits
    assert logits.shape == (BATCH, x.shape[1], model.config.vocab_size)
    (logits * weights).sum().backward()

    prompt = prompts.prompt_embeddings.detach().clone().requires_grad_(True)
    deep = None
    if mode == "deep_ptune":
        deep = prompts.deep_prompt_embeddings.detach().clone().requires_grad_(True)
    expected = local_logits(swarm.local, x, prompt, deep)
    (expected * weights).sum().backward()

    assert rel_err(logits.detach(), expected.detach()) < 1e-5
    assert rel_err(prompts.prompt_embeddings.grad, prompt.grad) < 1e-5
    assert prompt.grad.abs().sum() > 0
    if mode == "deep_ptune":
        assert rel_err(prompts.deep_prompt_embeddings.grad, deep.grad) < 1e-5
        assert all(deep.grad[i].abs().sum() > 0 for i in range(4))  # every block's prompt got its gradient
    else:
        assert prompts.deep_prompt_embeddings is None


def test_only_prompts_are_trainable_and_no_block_weights_are_local(swarm: Swarm) -> None:
    from distconf.blocks.weights import layer_prefixes

    model = swarm.model(tuning_mode="deep_ptune", pre_seq_len=PRE)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == ["ptune.deep_prompt_embeddings", "ptune.prompt_embeddings"]
    block_forms = tuple(p for i in range(4) for p in layer_prefixes(model.config, i))
    assert not [n for n, _ in model.named_parameters() if n.startswith(block_forms)]
    local_names = {n for n, _ in swarm.local.named_parameters() if not n.startswith(block_forms)}
    assert {n for n, _ in model.named_parameters()} == local_names | set(trainable)
    # a client-side head the user chooses to train gets gradients too
    model.lm_head.requires_grad_(True)
    x = ids(1)
    loss = model(x, labels=x, use_cache=False).loss  # the usual Hugging Face loss, over the user's positions
    assert torch.isfinite(loss)
    loss.backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    assert model.ptune.prompt_embeddings.grad is not None


def test_prompts_change_outputs_and_hidden_states_hide_prompt_positions(swarm: Swarm) -> None:
    plain = swarm.model()
    tuned = swarm.model(tuning_mode="ptune", pre_seq_len=PRE)
    x = ids(2)
    with torch.no_grad():
        a = plain(x, use_cache=False)
        b = tuned(x, use_cache=False)
        hidden = tuned.model(x, use_cache=False).last_hidden_state  # the base model's output
    assert a.logits.shape == b.logits.shape == (BATCH, x.shape[1], plain.config.vocab_size)
    assert hidden.shape == (BATCH, x.shape[1], tuned.config.hidden_size)
    assert not torch.allclose(a.logits, b.logits, atol=1e-4)
    assert plain.prompts is None


def test_bfloat16_client_trains_float32_prompts_with_the_chunked_head(swarm: Swarm) -> None:
    """A half-precision client: prompts stay float32, the LM head chunks ("auto" on CPU), gradients arrive."""
    from distconf.client.lmhead import chunked_forward_wanted

    full = swarm.model(tuning_mode="deep_ptune", pre_seq_len=PRE)
    half = swarm.model(tuning_mode="deep_ptune", pre_seq_len=PRE, dtype=torch.bfloat16, chunked_forward_step=50)
    randomize(full.prompts, seed=11)
    half.prompts.load_state_dict(full.prompts.state_dict())
    head = half.get_output_embeddings()
    assert chunked_forward_wanted(half.config.use_chunked_forward, head.weight.device, head.weight.dtype)
    assert head.weight.dtype == torch.bfloat16 and half.prompts.prompt_embeddings.dtype == torch.float32
    x = ids(12)
    logits = half(x, use_cache=False).logits
    assert logits.dtype == torch.bfloat16
    with torch.no_grad():
        reference = full(x, use_cache=False).logits
    assert rel_err(logits.detach().float(), reference) < 0.05  # bfloat16 rounding through 4 blocks
    logits.float().logsumexp(-1).sum().backward()
    for p in half.prompts.parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()
        assert p.grad.abs().sum() > 0


def test_output_hidden_states_are_the_blocks_input_and_output_without_prompt_positions(swarm: Swarm) -> None:
    plain = swarm.model()
    tuned = swarm.model(tuning_mode="deep_ptune", pre_seq_len=PRE)
    x = ids(13)
    with torch.no_grad():
        got = plain(x, use_cache=False, output_hidden_states=True).hidden_states
        want = swarm.local(x, use_cache=False, output_hidden_states=True).hidden_states
        tuned_states = tuned(x, use_cache=False, output_hidden_states=True).hidden_states
    assert len(got) == 2  # the layers are remote: the first block's input and the last block's output
    assert torch.allclose(got[0], want[0]) and torch.allclose(got[-1], want[-1], atol=1e-5)
    assert [tuple(h.shape) for h in tuned_states] == [(BATCH, x.shape[1], tuned.config.hidden_size)] * 2


def greedy_local(local: Any, x: torch.Tensor, prompt: torch.Tensor, deep: torch.Tensor | None, n: int,
                 scores: list[torch.Tensor] | None = None) -> list[list[int]]:
    """Greedy decoding with the local reference (each step's last logits appended to ``scores``)."""
    with torch.no_grad():
        for _ in range(n):
            last = local_logits(local, x, prompt, deep)[:, -1]
            if scores is not None:
                scores.append(last)
            x = torch.cat([x, last.argmax(-1, keepdim=True)], dim=1)
    return x.tolist()


def test_generation_with_trained_prompts_equals_local(swarm: Swarm) -> None:
    model = swarm.model(tuning_mode="deep_ptune", pre_seq_len=PRE)
    randomize(model.prompts, seed=5)
    x = ids(4)
    with torch.no_grad():
        got = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False,
                             pad_token_id=0).tolist()
    p = model.prompts
    assert got == greedy_local(swarm.local, x, p.prompt_embeddings.detach(), p.deep_prompt_embeddings.detach(), 6)
    # with server-to-server push: the step carrying deep prompts is not pushed, the later ones are
    pushed = swarm.model(tuning_mode="deep_ptune", pre_seq_len=PRE, use_server_to_server=True)
    pushed.prompts.load_state_dict(model.prompts.state_dict())
    with torch.no_grad():
        assert pushed.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False,
                               pad_token_id=0).tolist() == got
    # a cache reused across calls keeps the prompts on the servers: a rewind to 0 does not drop them
    with model.inference_session(16) as cache:
        first = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=3, do_sample=False,
                               pad_token_id=0, cache=cache)
        assert cache.get_seq_length() == x.shape[1] + 2
        assert cache.session.position == PRE + x.shape[1] + 2
        assert first.tolist() == [row[: x.shape[1] + 3] for row in got]


def test_beam_search_with_prompts_equals_local(swarm: Swarm) -> None:
    model = swarm.model(tuning_mode="ptune", pre_seq_len=PRE)
    randomize(model.prompts, seed=15)
    x = ids(14)
    kwargs = {"max_new_tokens": 5, "num_beams": 2, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        got = model.generate(x, attention_mask=torch.ones_like(x), **kwargs)[:, x.shape[1]:]
        embeds = swarm.local.get_input_embeddings()(x)
        prefix = model.prompts.prompt_embeddings.unsqueeze(0).expand(BATCH, -1, -1)
        embeds = torch.cat([prefix, embeds], dim=1)
        want = swarm.local.generate(inputs_embeds=embeds, attention_mask=torch.ones(embeds.shape[:2], dtype=torch.long),
                                    **kwargs)
    assert got.tolist() == want[:, -got.shape[1]:].tolist()


def test_save_pretrained_keeps_trained_prompts(swarm: Swarm, tmp_path: Path) -> None:
    model = swarm.model(tuning_mode="deep_ptune", pre_seq_len=PRE)
    randomize(model.prompts, seed=7)
    model.save_pretrained(tmp_path / "tuned")
    again = swarm.model(tmp_path / "tuned")
    assert again.config.tuning_mode == "deep_ptune" and again.config.pre_seq_len == PRE
    assert again.config.dht_prefix == model.config.dht_prefix
    for name, tensor in model.ptune.state_dict().items():
        assert torch.equal(again.ptune.state_dict()[name], tensor), name
    x = ids(6)
    with torch.no_grad():
        assert torch.allclose(again(x, use_cache=False).logits, model(x, use_cache=False).logits, atol=1e-6)
    # `distconf generate` on the saved folder runs with the trained prompts
    import os
    import sys

    from client_swarm import REPO

    result = forkserver.run(
        [sys.executable, "-m", "distconf.cli.cmd_generate", str(tmp_path / "tuned"), "--initial-peers", *swarm.peers,
         "--ids", "5,17,42", "--max-new-tokens", "5"],
        timeout=180, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-2000:]
    prompt = torch.tensor([[5, 17, 42]])
    with torch.no_grad():
        expected = again.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False,
                                  pad_token_id=0)[0, 3:].tolist()
    assert [int(t) for t in result.stdout.split()] == expected
    with torch.no_grad():  # the prompts matter: without them the tokens differ
        plain = swarm.local.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5,
                                     do_sample=False, pad_token_id=0)[0, 3:].tolist()
    assert plain != expected
    # a saved prompt tensor of the wrong shape is named, with its file
    from safetensors.torch import load_file, save_file

    path = tmp_path / "tuned" / "model.safetensors"
    tensors = load_file(path)
    tensors["ptune.prompt_embeddings"] = tensors["ptune.prompt_embeddings"][:1]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.safetensors: ptune\.prompt_embeddings has shape \[1, "):
        swarm.model(tmp_path / "tuned")


def test_failover_with_deep_prompts_replays_them(swarm: Swarm) -> None:
    """A server of the session dies mid-generation: the replacement gets the history and the prompts."""
    from transformers import LogitsProcessor, LogitsProcessorList

    model = swarm.model(tuning_mode="deep_ptune", pre_seq_len=PRE, ban_timeout=600.0, min_backoff=0.05)
    randomize(model.prompts, seed=9)
    x = ids(10)
    p = model.prompts
    scores: list[torch.Tensor] = []
    expected = greedy_local(swarm.local, x, p.prompt_embeddings.detach(), p.deep_prompt_embeddings.detach(), 8,
                            scores)
    by_peer = {s.peer_id: s for s in swarm.servers}

    class KillAfterFourTokens(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if input_ids.shape[1] == x.shape[1] + 4 and not swarm.killed:
                victim = cache.session.sessions[-1].peer_id
                by_peer[victim].kill()
                swarm.killed.add(victim)
            return scores

    with model.inference_session(32) as cache, torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False,
                             pad_token_id=0, cache=cache, logits_processor=LogitsProcessorList([KillAfterFourTokens()]),
                             output_logits=True, return_dict_in_generate=True)
        assert swarm.killed and cache.session.failovers == 1
    assert out.sequences.tolist() == expected
    for got, want in zip(out.logits, scores):  # the steps after the failover too: the prompts were replayed
        assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())


def test_training_deep_ptune_halves_the_loss_and_servers_keep_their_weights(swarm: Swarm) -> None:
    """20 Adam steps teach the model to answer a fixed prompt with a fixed token; runs last (stops the servers)."""
    from client_swarm import server_info

    model = swarm.model(tuning_mode="deep_ptune", pre_seq_len=PRE)
    alive = [s for s in swarm.servers if s.peer_id not in swarm.killed]
    digests = [server_info(model, s.peer_id)["weights_sha256"] for s in alive]
    x = ids(8)
    target = torch.full((BATCH,), 17)
    optimizer = torch.optim.Adam(model.prompts.parameters(), lr=0.05)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x, use_cache=False).logits[:, -1], target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] <= 0.5 * losses[0], losses
    with torch.no_grad():
        answer = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=1, do_sample=False,
                                pad_token_id=0)[:, -1]
    stop_all(swarm.servers)
    for server, digest in zip(alive, digests):
        log = server.log_path.read_text()
        at_load = re.search(r"weights sha256 of blocks \S+ at load: ([0-9a-f]{64})", log)
        at_stop = re.search(r"weights sha256 of blocks \S+ at stop: ([0-9a-f]{64}) \(unchanged\)", log)
        assert at_load and at_stop, log[-2000:]
        assert at_load.group(1) == at_stop.group(1) == digest
    if losses[-1] < 0.7:  # well trained: the answer is the target
        assert answer.tolist() == target.tolist()


def test_backward_reply_with_per_row_prompt_gradients_is_summed() -> None:
    """Prompts sent with batch 1: a server (Petals 2.x does) may reply with one gradient per batch row."""
    from distconf.client.sequential import _check_backward_reply
    from distconf.dht import RemoteSpan, ServerInfo

    hop = RemoteSpan(peer_id="12D3KooWPeer", start=0, end=2, info=ServerInfo(state=2, throughput=1.0))
    inputs = torch.zeros(3, 7, 8)
    prompts = torch.zeros(2, 1, 4, 8)
    per_row = torch.randn(2, 3, 4, 8)
    assert torch.equal(_check_backward_reply(hop, [inputs, per_row], inputs, prompts), per_row.sum(1, keepdim=True))
    summed = per_row.sum(1, keepdim=True)
    assert torch.equal(_check_backward_reply(hop, [inputs, summed], inputs, prompts), summed)
    assert _check_backward_reply(hop, [inputs], inputs, None) is None
    for bad in ([inputs], [inputs, torch.zeros(2, 3, 5, 8)], [inputs, torch.zeros(3, 1, 4, 8)]):
        with pytest.raises(ConnectionError, match="deep-prompt gradient"):
            _check_backward_reply(hop, bad, inputs, prompts)
    with pytest.raises(ConnectionError, match=r"a gradient of shape \[3, 6, 8\]"):
        _check_backward_reply(hop, [torch.zeros(3, 6, 8)], inputs, prompts)
