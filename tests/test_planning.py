"""Capacity planning and placement against hand-computed figures for real model configs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from distconf.blocks.quant import nf4_cpu_packed
from distconf.dht.discovery import SwarmState, merge_spans
from distconf.dht.records import ServerInfo, ServerState
from distconf.planning import choose_blocks, parse_memory, plan_server

GIB = 2**30
MEMORY = 24 * GIB
NF4 = 4.25 / 8

# Parameters of one block, counted by hand from each model's config.json:
# Llama-2-70B: hidden 8192, 64 heads, 8 KV heads x 128, MLP 28672 (gate, up, down), 2 RMSNorms.
LLAMA_70B = 2 * 8192 * 8192 + 2 * 8192 * 8 * 128 + 3 * 8192 * 28672 + 2 * 8192
# Mixtral-8x7B: same attention shape at hidden 4096 (32 heads, 8 KV heads), 8 experts of 3 x 4096 x 14336,
# router 4096 x 8, 2 RMSNorms.
MIXTRAL = 2 * 4096 * 4096 + 2 * 4096 * 8 * 128 + 8 * 3 * 4096 * 14336 + 4096 * 8 + 2 * 4096
# Falcon-40B: fused QKV 8192 x (128 + 2 x 8) x 64, dense 8192^2, MLP 8192 x 32768 x 2, two LayerNorms (w + b).
FALCON_40B = 8192 * (128 + 2 * 8) * 64 + 8192 * 8192 + 2 * 8192 * 32768 + 4 * 8192
# BLOOM-176B: QKV 14336 x 3 x 14336 + bias, dense + bias, MLP 14336 -> 57344 -> 14336 with biases, 2 LayerNorms.
H = 14336
BLOOM = 3 * H * H + 3 * H + H * H + H + H * 4 * H + 4 * H + 4 * H * H + H + 4 * H
# nf4 quantizes nn.Linear weights only: (Linear weight parameters, Linear count). Mixtral's experts are fused
# 3-D parameters in transformers (not nn.Linear): they stay bf16, as its router and every norm and bias.
NF4_LINEARS = {
    "meta-llama/Llama-2-70b-hf": (LLAMA_70B - 2 * 8192, 7),
    "mistralai/Mixtral-8x7B-v0.1": (2 * 4096 * 4096 + 2 * 4096 * 8 * 128, 4),
    "tiiuae/falcon-40b": (FALCON_40B - 4 * 8192, 4),
    "bigscience/bloom": (BLOOM - 3 * H - H - 4 * H - H - 4 * H, 4),
}
NF4_TABLES = 64 + 4  # per Linear: the NF4 codebook (16 fp32) and double quantization's offset


def nf4_block_bytes(name: str, params: int) -> int:
    """Hand figure of an nf4 block on an AVX512-BF16 CPU: 4.25 bits per Linear weight, the rest bf16."""
    from distconf.blocks.quant import nf4_cpu_packed

    if not nf4_cpu_packed():
        pytest.skip("nf4 hand figures are for bitsandbytes' AVX512-BF16 CPU layout")
    linear, count = NF4_LINEARS[name]
    return int((linear * NF4 + count * NF4_TABLES + (params - linear) * 2) * 1.01)

# (preset, params, KV bytes/token/block in bf16, cache tokens, hidden_size, layers, Petals 2.x KV bytes/token)
CASES = [
    ("meta-llama/Llama-2-70b-hf", LLAMA_70B, 2 * 8 * 128 * 2, 16384, 8192, 80, 2 * 8192 // 8 * 2),
    ("mistralai/Mixtral-8x7B-v0.1", MIXTRAL, 2 * 8 * 128 * 2, 16384, 4096, 32, 2 * 4096 // 1 * 2),
    ("tiiuae/falcon-40b", FALCON_40B, 2 * 8 * 64 * 2, 16384, 8192, 60, 2 * 8192 // 16 * 2),
    ("bigscience/bloom", BLOOM, 2 * 112 * 128 * 2, 4096, 14336, 70, 2 * 14336 // 1 * 2),
]


def expected_blocks(block_bytes: int, cache_per_block: int, hidden: int, layers: int) -> int:
    reserve = 2 * GIB * hidden / 14336
    return min(layers, math.floor((MEMORY - reserve) / (block_bytes + cache_per_block)))


@pytest.fixture(scope="module")
def presets():
    from distconf import load_preset

    return {case[0]: load_preset(case[0]) for case in CASES}


def test_petals_groups_come_from_the_family_file(presets) -> None:
    from distconf.planning import petals_kv_groups

    assert petals_kv_groups(presets["mistralai/Mixtral-8x7B-v0.1"]) == 1  # Petals 2.x hard-codes 1
    assert petals_kv_groups(presets["meta-llama/Llama-2-70b-hf"]) == 8


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("quant", [None, "nf4"])
def test_plan_matches_hand_computation(presets, case, quant):
    name, params, kv_bytes, tokens, hidden, layers, orig_kv_bytes = case
    plan = plan_server(presets[name], MEMORY, "bf16", quant)
    block = nf4_block_bytes(name, params) if quant else int(params * 2 * 1.01)
    assert plan.block_bytes == block
    assert plan.kv_bytes_per_token == kv_bytes
    assert plan.attn_cache_tokens == tokens
    assert plan.cache_bytes_per_block == kv_bytes * tokens
    assert plan.num_blocks == expected_blocks(block, kv_bytes * tokens, hidden, layers)
    assert plan.cache_tokens == tokens
    assert plan.petals_kv_bytes_per_token == orig_kv_bytes
    assert plan.petals_num_blocks == expected_blocks(block, orig_kv_bytes * tokens, hidden, layers)
    assert plan.used_bytes <= MEMORY


def test_hand_figures_for_the_record(presets):
    """The figures quoted in the docs (24 GiB, bf16 / nf4)."""
    figures = {name: (plan_server(presets[name], MEMORY).num_blocks, plan_server(presets[name], MEMORY,
                                                                                   quant="nf4").num_blocks)
               for name, *_ in CASES}
    assert figures == {
        "meta-llama/Llama-2-70b-hf": (13, 46 if nf4_cpu_packed() else 47),  # the CPU kernel's nf4 layout or bnb's
        "mistralai/Mixtral-8x7B-v0.1": (8, 8),  # nf4 leaves its fused experts in bf16
        "tiiuae/falcon-40b": (17, 60),
        "bigscience/bloom": (4, 15),
    }


def test_petals_formula_over_reserves_mixtral_four_times(presets):
    plan = plan_server(presets["mistralai/Mixtral-8x7B-v0.1"], MEMORY)
    assert plan.petals_kv_groups == 1
    assert plan.petals_over_reservation == 4.0
    assert (plan.num_blocks, plan.petals_num_blocks) == (8, 7)
    assert (plan.petals_default_attn_cache_tokens, plan.petals_default_num_blocks) == (4096, 8)
    for name in ("meta-llama/Llama-2-70b-hf", "tiiuae/falcon-40b", "bigscience/bloom"):
        assert plan_server(presets[name], MEMORY).petals_over_reservation == 1.0


def test_plan_options(presets):
    llama = presets["meta-llama/Llama-2-70b-hf"]
    small = plan_server(llama, 2 * GIB)
    assert small.num_blocks == 0 and small.cache_tokens == 0
    big = plan_server(llama, "10TiB")
    assert big.num_blocks == 80  # capped at the layer count
    custom = plan_server(llama, MEMORY, attn_cache_tokens=1024)
    assert custom.cache_bytes_per_block == 4096 * 1024 and custom.num_blocks >= 13
    assert plan_server(llama, MEMORY, "fp32").kv_bytes_per_token == 8192
    with pytest.raises(ValueError, match="quant"):
        plan_server(llama, MEMORY, quant="int3")
    with pytest.raises(ValueError, match="dtype"):
        plan_server(llama, MEMORY, "int7")
    # explicit sizes: no block is built
    cfg = SimpleNamespace(hidden_size=14336, num_hidden_layers=10, num_key_value_groups=1, model_type="x")
    plan = plan_server(cfg, 4 * GIB, block_bytes=GIB // 2, kv_bytes_per_token=GIB // 2 // 4096)
    assert plan.num_blocks == 2  # (4 GiB - 2 GiB reserve) / (0.5 GiB + 0.5 GiB)


# Granite-4.0-H-Tiny (hybrid): 4 attention layers (4 KV heads x 128, bf16) and 36 Mamba-2 layers whose conv window
# is (2 x 1536 + 2 x 1 group x 128) channels x 4 (bf16) and whose SSM state is 48 heads x 64 x 128 (float32).
GRANITE_H_KV = 4 * (128 + 128) * 2
GRANITE_H_STATE = (2 * 1536 + 2 * 1 * 128) * 4 * 2 + 48 * 64 * 128 * 4


def test_hybrid_plan_counts_each_block_by_what_it_keeps(capsys) -> None:
    from distconf import load_preset
    from distconf.cli import main

    plan = plan_server(load_preset("ibm-granite/granite-4.0-h-tiny"), MEMORY)
    assert (plan.kv_bytes_per_token, plan.state_bytes_per_sequence) == (GRANITE_H_KV, GRANITE_H_STATE)
    assert (plan.kv_blocks, plan.state_blocks, plan.max_blocks) == (4, 36, 40)
    sequences = 2 * 1536 * 2 * 16384 // GRANITE_H_STATE  # the memory of 16384 tokens of K/V at this hidden size
    assert plan.state_sequences == sequences == 62
    # no block keeps both: each block is reserved the larger of the two caches, not their sum
    assert plan.cache_bytes_per_block == max(GRANITE_H_KV * 16384, GRANITE_H_STATE * sequences)
    assert main(["plan", "ibm-granite/granite-4.0-h-tiny", "--memory", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert f"{GRANITE_H_KV:,}" in out and f"{GRANITE_H_STATE:,}" in out
    assert "4 of 40 blocks keep K/V (2,048 bytes/token), 36 keep a state (1,599,488 bytes/sequence)" in out
    assert "every block is reserved the cache of the largest block" in out


def test_parse_memory():
    assert parse_memory("24GiB") == 24 * GIB
    assert parse_memory("80 GB") == 80 * 10**9
    assert parse_memory("1.5 MiB") == 3 * 2**19
    assert parse_memory(1234) == 1234
    for bad in ("", "GiB", "24 parsecs", "-1GiB", "0"):
        with pytest.raises(ValueError):
            parse_memory(bad)


# ------------------------------------------------------------------------------ placement

def cfg(n):
    return SimpleNamespace(num_hidden_layers=n)


def test_choose_blocks_fills_the_weakest_window():
    assert choose_blocks(cfg(8), 3) == (0, 3)  # empty swarm: first window
    assert choose_blocks(cfg(8), 3, [5, 5, 5, 0, 0, 0, 0, 0]) == (3, 6)
    assert choose_blocks(cfg(8), 3, [5, 5, 5, 5, 5, 5, 0, 0]) == (5, 8)
    assert choose_blocks(cfg(6), 2, [3, 1, 2, 2, 1, 3]) == (1, 3)  # sorted [1, 2] at 1 and 3: lowest start
    assert choose_blocks(cfg(6), 2, [3, 9, 2, 2, 9, 3]) == (2, 4)
    assert choose_blocks(cfg(4), 10) == (0, 4)  # capped
    with pytest.raises(ValueError, match="at least one block"):
        choose_blocks(cfg(4), 0)
    with pytest.raises(ValueError, match="blocks"):
        choose_blocks(cfg(4), 2, [1, 2, 3])


def test_choose_blocks_reads_a_swarm_state_and_ignores_offline_servers():
    def info(state, t):
        return ServerInfo(state=state, throughput=t)

    servers = [{"A": info(ServerState.ONLINE, 4.0)} for _ in range(4)] + [
        {"B": info(ServerState.OFFLINE, 100.0)} for _ in range(4)]
    state = SwarmState("m", 8, servers, merge_spans(servers))
    assert state.throughputs() == [4.0] * 4 + [0.0] * 4
    assert choose_blocks(cfg(8), 4, state) == (4, 8)


def test_successive_servers_cover_the_chain():
    throughputs = [0.0] * 10
    spans = []
    for _ in range(4):
        start, end = choose_blocks(cfg(10), 3, throughputs)
        spans.append((start, end))
        for i in range(start, end):
            throughputs[i] += 1.0
    assert min(throughputs) >= 1.0, spans
