"""`distconf.client.textgen` on the real model run locally (its own KV cache stands for the swarm's session).

Greedy text equals transformers' greedy ``generate``; stop strings cut exactly (also across tokens);
pieces never split a character; seeds repeat; ``max_tokens`` ends with "length"; close ends early.
"""

from __future__ import annotations

from typing import Any

import pytest
from real_helpers import local_sessions
from transformers import DynamicCache

from distconf.client.textgen import IncrementalDecoder, Sampling, chat_input_ids, stream_text
from distconf.tools import real_model as rm


class _ClosableCache(DynamicCache):
    """A local cache with the ``close`` a remote session has (counts the calls)."""

    closed = 0

    def close(self) -> None:
        type(self).closed += 1


@pytest.fixture(scope="module")
def tokenizer(real_tokenizer: Any) -> Any:
    return real_tokenizer


@pytest.fixture(scope="module")
def model(real_local: Any) -> Any:
    with local_sessions(real_local, _ClosableCache) as local:
        yield local


def _ids(tokenizer: Any, question: str = rm.QUESTION) -> list[int]:
    return chat_input_ids(tokenizer, [{"role": "user", "content": question}])


def test_chat_input_ids_are_the_template(tokenizer: Any) -> None:
    assert _ids(tokenizer) == rm.chat_ids(tokenizer)[0].tolist()


def test_greedy_is_transformers_greedy(model: Any, tokenizer: Any) -> None:
    text, tokens = rm.greedy_answer(model, tokenizer, max_new_tokens=24)
    stream = stream_text(model, tokenizer, _ids(tokenizer), Sampling(max_tokens=24, temperature=0))
    pieces = list(stream)
    assert "".join(p.text for p in pieces).strip() == text == rm.ANSWER
    assert [p.token_id for p in pieces] == tokens[:len(pieces)]
    assert stream.finish_reason == "stop"  # end of turn
    assert stream.completion_tokens == len(pieces) + 1  # the end of turn counts
    assert stream.prompt_tokens == len(_ids(tokenizer))
    assert all(p.logprob is not None and p.logprob <= 0 for p in pieces)


@pytest.mark.parametrize("stop, expected", [("Paris", "The capital of France is "), ("of Fr", "The capital "),
                                            ("capital", "The ")])
def test_stop_strings_cut_exactly(model: Any, tokenizer: Any, stop: str, expected: str) -> None:
    stream = stream_text(model, tokenizer, _ids(tokenizer), Sampling(max_tokens=24, temperature=0,
                                                                      stop=("never there", stop)))
    assert "".join(p.text for p in stream) == expected
    assert stream.finish_reason == "stop"


def test_max_tokens_and_close(model: Any, tokenizer: Any) -> None:
    stream = stream_text(model, tokenizer, _ids(tokenizer), Sampling(max_tokens=3, temperature=0))
    assert "".join(p.text for p in stream) == "The capital of"
    assert stream.finish_reason == "length" and stream.completion_tokens == 3
    before = _ClosableCache.closed
    early = stream_text(model, tokenizer, _ids(tokenizer), Sampling(max_tokens=20, temperature=0))
    next(iter(early))
    early.close()
    assert _ClosableCache.closed > before
    assert list(early) == [] and early.finish_reason is None


def test_seeded_sampling_repeats(model: Any, tokenizer: Any) -> None:
    def sample(seed: int) -> list[int]:
        s = Sampling(max_tokens=8, temperature=1.2, top_p=0.9, seed=seed, top_logprobs=2)
        pieces = list(stream_text(model, tokenizer, _ids(tokenizer, "Tell me a story."), s))
        assert all(len(p.top_logprobs) == 2 for p in pieces)
        return [p.token_id for p in pieces]

    assert sample(7) == sample(7)


def test_top_k_one_is_greedy_and_no_tokenizer_gives_ids(model: Any, tokenizer: Any) -> None:
    greedy = [p.token_id for p in stream_text(model, tokenizer, _ids(tokenizer), Sampling(max_tokens=6, temperature=0))]
    top1 = Sampling(max_tokens=6, temperature=1.5, top_k=1, seed=3)
    assert [p.token_id for p in stream_text(model, tokenizer, _ids(tokenizer), top1)] == greedy
    pieces = list(stream_text(model, None, _ids(tokenizer), Sampling(max_tokens=6, temperature=0)))
    assert [p.token_id for p in pieces] == greedy and all(p.text == "" for p in pieces)


def test_pieces_never_split_a_character(tokenizer: Any) -> None:
    text = "Ça coûte 5 €, 東京 🙂!"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.add(i) for i in ids]
    assert "".join(pieces) + decoder.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces)  # some token ends inside a character


def test_bad_sampling_is_refused() -> None:
    for bad in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"stop": ("",)}, {"top_k": 0}):
        with pytest.raises(ValueError):
            Sampling(**bad)
