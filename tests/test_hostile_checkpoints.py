"""Checkpoints may come from anywhere: crafted safetensors files and indexes written here.

Every malformed file or index must give a `BlockWeightsError` naming the file (and the
tensor at fault), never wrong weights, a raw parsing error, a huge allocation or a hang.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import threading
from pathlib import Path

import forkserver
import pytest
import safetensors
import safetensors.torch
import torch
from blockhelpers import family_config, hf_layer, hf_model, save_checkpoint
from dhthelpers import wait_for
from safetensors.torch import save_file

from distconf.blocks.weights import BlockWeightsError, checkpoint_files, load_block, load_block_weights

TESTS = Path(__file__).resolve().parent
T = "model.layers.0.input_layernorm.weight"  # float32 [64]
OTHER = "model.layers.0.post_attention_layernorm.weight"  # float32 [64]


@pytest.fixture(scope="module")
def llama():
    config, hf_config, _ = family_config("llama")
    return config, hf_model(hf_config)


def _layer_state(model, config, i: int = 0) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.{k}": v.contiguous() for k, v in hf_layer(model, config, i).state_dict().items()}


def _split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + size]), raw[8 + size:]


def _join(path: Path, header: dict | None, data: bytes = b"", raw_header: bytes | None = None) -> None:
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _single(tmp_path: Path, llama, change=None) -> Path:
    """A single-file checkpoint of layer 0; ``change(header, data)`` may rewrite it."""
    config, model = llama
    path = tmp_path / "model.safetensors"
    save_file(_layer_state(model, config), str(path))
    if change is not None:
        header, data = _split(path)
        data = change(header, data) or data
        _join(path, header, data)
    return path


def _cut_out(header: dict, data: bytes, name: str) -> bytes:
    """Remove tensor ``name``'s bytes from the data and shift the offsets after it."""
    begin, end = header[name]["data_offsets"]
    for key, entry in header.items():
        if key != "__metadata__" and entry["data_offsets"][0] >= end:
            entry["data_offsets"] = [o - (end - begin) for o in entry["data_offsets"]]
    return data[:begin] + data[end:]


def _set(field, value):
    def change(header, data):
        header[T][field] = value(header, data) if callable(value) else value
    return change


def _overlap(header, data):
    data = _cut_out(header, data, T)
    header[T]["data_offsets"] = list(header[OTHER]["data_offsets"])
    return data


OFFSET_CASES = {
    "empty": _set("data_offsets", []),
    "short": _set("data_offsets", lambda h, d: h[T]["data_offsets"][:1]),
    "reversed": _set("data_offsets", lambda h, d: h[T]["data_offsets"][::-1]),
    "negative, inside the header": _set("data_offsets", [-200, 56]),
    "past the end": _set("data_offsets", lambda h, d: [len(d) - 128, len(d) + 128]),
    "overlapping another tensor": _overlap,
    "F64 over F32 bytes": _set("dtype", "F64"),
    "I8 over F32 bytes": _set("dtype", "I8"),
    "BOOL over F32 bytes": _set("dtype", "BOOL"),
    "float offsets": _set("data_offsets", lambda h, d: [float(o) for o in h[T]["data_offsets"]]),
    "huge shape": _set("shape", [10**30]),
    "string entry": lambda h, d: h.__setitem__(T, "weights"),
}


@pytest.mark.parametrize("case", OFFSET_CASES)
def test_invalid_tensor_entry_names_file_and_tensor(tmp_path, llama, case) -> None:
    config, _ = llama
    _single(tmp_path, llama, OFFSET_CASES[case])
    with pytest.raises(BlockWeightsError) as err:
        load_block_weights(tmp_path, config, 0)
    assert "model.safetensors" in str(err.value) and T in str(err.value)


MALFORMED_HEADERS = {
    "not UTF-8": b'{"\xff\xfe": 1}',
    "not JSON": b'{"model.layers.0.x": ',
    "deeply nested": b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "a list": b"[1, 2]",
    "metadata not strings": b'{"__metadata__": {"format": 1}}',
}


@pytest.mark.parametrize("case", MALFORMED_HEADERS)
def test_malformed_header_is_a_block_weights_error(tmp_path, llama, case) -> None:
    config, _ = llama
    _join(tmp_path / "model.safetensors", None, b"", MALFORMED_HEADERS[case])
    for call in (lambda: checkpoint_files(tmp_path), lambda: load_block_weights(tmp_path, config, 0)):
        with pytest.raises(BlockWeightsError, match=r"model\.safetensors"):
            call()


@pytest.mark.parametrize("content", [b"\x01\x02", struct.pack("<Q", 1 << 62) + b"{}", struct.pack("<Q", 50) + b"{}"])
def test_truncated_file_is_a_block_weights_error(tmp_path, llama, content) -> None:
    config, _ = llama
    (tmp_path / "model.safetensors").write_bytes(content)
    with pytest.raises(BlockWeightsError, match=r"model\.safetensors"):
        load_block_weights(tmp_path, config, 0)


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.int32])
def test_integer_data_never_loads_into_a_float_parameter(tmp_path, llama, dtype) -> None:
    config, model = llama
    state = _layer_state(model, config)
    state[T] = (state[T] * 10).to(dtype)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(BlockWeightsError) as err:
        load_block(tmp_path, config, 0, dtype=torch.float32)
    assert T in str(err.value) and "wrong dtype" in str(err.value)
    assert len(err.value.wrong_dtype) == 1 and err.value.wrong_dtype[0].startswith(T)
    assert err.value.wrong_dtype[0].endswith("block float32")


@pytest.mark.parametrize("stored", [torch.float64, torch.bfloat16, torch.float16])
def test_floating_checkpoint_casts_into_the_block(tmp_path, llama, stored) -> None:
    config, model = llama
    state = {k: v.to(stored) for k, v in _layer_state(model, config).items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    block = load_block(tmp_path, config, 0, dtype=torch.float32)
    for name, tensor in block.state_dict().items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, state[f"model.layers.0.{name}"].float(), atol=0, rtol=0)


# --------------------------------------------------------------------------- MoE shapes


@pytest.fixture(scope="module")
def moe():
    config, hf_config, _ = family_config("mixtral")
    return config, hf_model(hf_config)


def _expert_names(header: dict, layer: int = 0, kind: str = "w1") -> list[str]:
    return [k for k in header if k.startswith(f"model.layers.{layer}.") and k.endswith(f".{kind}.weight")
            and ".experts." in k]


def _huge_experts(directory: Path, side: int) -> str:
    path = directory / "model.safetensors"
    header, data = _split(path)
    names = _expert_names(header)
    for name in names:
        header[name]["shape"] = [side, side]
    _join(path, header, data)
    return names[0]


@pytest.mark.slow
def test_huge_declared_expert_shapes_are_refused_before_any_allocation(tmp_path, moe) -> None:
    """An ~800 KB file declaring 4 GB experts: refused from its header, under a 1 GiB address-space limit."""
    _, model = moe
    save_checkpoint(model, tmp_path, shards=1)
    assert (tmp_path / "model.safetensors").stat().st_size < 2 << 20
    _huge_experts(tmp_path, 1 << 15)
    script = f"""
import resource, sys
sys.path.insert(0, {str(TESTS)!r})
import torch
from blockhelpers import family_config
from distconf.blocks.weights import load_block
config, _, _ = family_config("mixtral")
import transformers.core_model_loading
vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
try:
    load_block({str(tmp_path)!r}, config, 0, dtype=torch.float32)
    print("LOADED")
except Exception as exc:
    print(type(exc).__name__, str(exc).replace(chr(10), " "))
"""
    out = forkserver.run([sys.executable, forkserver.script(script)], timeout=300)  # forked: see tests/forkserver.py
    line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]
    assert line.startswith("BlockWeightsError"), line
    assert "model.safetensors" in line and ".experts." in line and ".w1.weight" in line


def test_absurd_expert_shapes_are_a_block_weights_error(tmp_path, moe) -> None:
    config, model = moe
    save_checkpoint(model, tmp_path, shards=1)
    name = _huge_experts(tmp_path, 1 << 40)
    with pytest.raises(BlockWeightsError) as err:
        load_block_weights(tmp_path, config, 0)
    assert "model.safetensors" in str(err.value) and name in str(err.value)


def test_expert_indices_must_be_0_to_n_minus_1(tmp_path, moe) -> None:
    """Experts 0..2 and 4 (no 3): as many tensors as the block wants, but one expert is not there."""
    config, model = moe
    save_checkpoint(model, tmp_path, shards=1)
    path = tmp_path / "model.safetensors"
    header, data = _split(path)
    last = config.num_local_experts - 1
    header = {k.replace(f".experts.{last}.", f".experts.{last + 1}.") if k.startswith("model.layers.0.") else k: v
              for k, v in header.items()}
    _join(path, header, data)
    with pytest.raises(BlockWeightsError, match=r"experts\.\*\.w1\.weight.*not 0\.\.3"):
        load_block_weights(tmp_path, config, 0)
    load_block_weights(tmp_path, config, 1)  # other layers are intact


def test_two_tensors_for_one_parameter_are_refused(tmp_path, moe) -> None:
    """A legacy name and its renamed form, or per-expert tensors and the fused one: which would win is arbitrary."""
    config, model = moe
    save_checkpoint(model, tmp_path, shards=1)
    path = tmp_path / "model.safetensors"
    state = dict(safetensors.torch.load_file(str(path)))
    assert "model.layers.0.block_sparse_moe.gate.weight" in state
    state["model.layers.0.mlp.gate.weight"] = torch.zeros_like(state["model.layers.0.block_sparse_moe.gate.weight"])
    fused = hf_layer(model, config, 0).state_dict()["mlp.experts.down_proj"]
    state["model.layers.0.mlp.experts.down_proj"] = torch.zeros_like(fused)
    save_file(state, str(path))
    with pytest.raises(BlockWeightsError) as err:
        load_block_weights(tmp_path, config, 0)
    text = str(err.value)
    assert "same parameter as model.layers.0." in text
    assert "also stored as model.layers.0.mlp.experts.down_proj" in text


# --------------------------------------------------------------------------- index and paths


def _sharded(directory: Path, llama, shard_for) -> dict:
    """An index-backed checkpoint of layer 0; ``shard_for(name)`` gives each tensor's index entry."""
    config, model = llama
    directory.mkdir(parents=True, exist_ok=True)
    state = _layer_state(model, config)
    weight_map = {name: shard_for(name) for name in state}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return state


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_index_cannot_reach_outside_the_model_folder(tmp_path, llama, how) -> None:
    config, model = llama
    outside = tmp_path / "outside" / "evil.safetensors"
    outside.parent.mkdir()
    save_file(_layer_state(model, config), str(outside))
    folder = tmp_path / "model"
    entry = {"absolute": str(outside), "dotdot": "../outside/evil.safetensors", "symlink": "shard.safetensors"}[how]
    _sharded(folder, llama, lambda name: entry)
    if how == "symlink":
        (folder / "shard.safetensors").symlink_to(outside)
    with pytest.raises(BlockWeightsError) as err:
        load_block_weights(folder, config, 0)
    assert "outside" in str(err.value) or "not a file name inside" in str(err.value)


def test_symlinks_inside_the_folder_and_the_hub_cache_layout_load(tmp_path, llama) -> None:
    config, model = llama
    repo = tmp_path / "models--org--tiny"
    blob = repo / "blobs" / "0123abcd"
    blob.parent.mkdir(parents=True)
    save_file(_layer_state(model, config), str(blob))
    snapshot = repo / "snapshots" / "rev1"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to("../../blobs/0123abcd")
    reference = hf_layer(model, config, 0).state_dict()
    state = load_block_weights(snapshot, config, 0)
    assert all(torch.equal(state[k], reference[k]) for k in reference)
    inside = tmp_path / "plain"
    (inside / "real").mkdir(parents=True)
    save_file(_layer_state(model, config), str(inside / "real" / "data.safetensors"))
    (inside / "model.safetensors").symlink_to("real/data.safetensors")
    assert set(load_block_weights(inside, config, 0)) == set(reference)


class _FifoProbe:
    """Polls a FIFO's write end: it opens only if someone opened the FIFO for reading (then unblocks them)."""

    def __init__(self, path: Path) -> None:
        os.mkfifo(path)
        self.path, self.reader_seen, self._stop = path, False, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        wait_for(lambda: self._stop.is_set() or self._try_open(), timeout=60, interval=0.01)

    def _try_open(self) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: nobody reads
            return False
        self.reader_seen = True
        os.close(fd)  # the reader sees end of file instead of hanging
        return True

    def stop(self) -> bool:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.reader_seen


@pytest.mark.parametrize("where", ["shard", "single file", "index"])
def test_a_fifo_is_never_opened(tmp_path, llama, where) -> None:
    config, _ = llama
    if where == "shard":
        _sharded(tmp_path, llama, lambda name: "fifo.safetensors")
        probe = _FifoProbe(tmp_path / "fifo.safetensors")
    else:
        probe = _FifoProbe(tmp_path / ("model.safetensors" if where == "single file"
                                       else "model.safetensors.index.json"))
    try:
        with pytest.raises(BlockWeightsError, match="not a regular file"):
            load_block_weights(tmp_path, config, 0)
    finally:
        opened = probe.stop()
    assert not opened


MALFORMED_INDEXES = {
    "not UTF-8": b'{"weight_map": {"\xff": "a"}}',
    "not JSON": b'{"weight_map": ',
    "deeply nested": b'{"weight_map": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "no weight_map": b'{"metadata": {}}',
    "weight_map a list": b'{"weight_map": ["model.safetensors"]}',
    "file name a number": b'{"weight_map": {"model.layers.0.input_layernorm.weight": 5}}',
    "a list": b"[]",
    "empty file name": b'{"weight_map": {"model.layers.0.input_layernorm.weight": ""}}',
}


@pytest.mark.parametrize("case", MALFORMED_INDEXES)
def test_malformed_index_is_a_block_weights_error(tmp_path, llama, case) -> None:
    config, _ = llama
    (tmp_path / "model.safetensors.index.json").write_bytes(MALFORMED_INDEXES[case])
    for call in (lambda: checkpoint_files(tmp_path), lambda: load_block_weights(tmp_path, config, 0)):
        with pytest.raises(BlockWeightsError, match=r"model\.safetensors\.index\.json"):
            call()


def test_oversized_index_is_not_read(tmp_path, llama) -> None:
    config, _ = llama
    with open(tmp_path / "model.safetensors.index.json", "wb") as f:
        f.truncate(65 << 20)  # sparse: costs no disk
    with pytest.raises(BlockWeightsError, match="larger than 64 MiB"):
        load_block_weights(tmp_path, config, 0)


def test_missing_shard_and_missing_tensor_name_the_file(tmp_path, llama) -> None:
    config, _ = llama
    state = _sharded(tmp_path, llama, lambda name: "a.safetensors" if name != T else "b.safetensors")
    save_file({k: v for k, v in state.items() if k != T}, str(tmp_path / "a.safetensors"))
    with pytest.raises(BlockWeightsError, match=r"b\.safetensors"):
        load_block_weights(tmp_path, config, 0)
    save_file({OTHER: state[OTHER]}, str(tmp_path / "b.safetensors"))
    with pytest.raises(BlockWeightsError, match=rf"b\.safetensors.*{T}"):
        load_block_weights(tmp_path, config, 0)


def test_nothing_is_half_loaded(tmp_path, llama) -> None:
    """Layer 0 spans two shards and the second is corrupt: no block comes back, the first's data is unused."""
    config, _ = llama
    state = _sharded(tmp_path, llama, lambda name: "b.safetensors" if name == T else "a.safetensors")
    save_file({k: v for k, v in state.items() if k != T}, str(tmp_path / "a.safetensors"))
    save_file({T: state[T]}, str(tmp_path / "b.safetensors"))
    header, data = _split(tmp_path / "b.safetensors")
    header[T]["data_offsets"] = header[T]["data_offsets"][::-1]
    _join(tmp_path / "b.safetensors", header, data)
    with pytest.raises(BlockWeightsError, match=rf"b\.safetensors.*{T}"):
        load_block(tmp_path, config, 0)


def test_each_file_header_is_parsed_once_per_load(tmp_path, llama, monkeypatch) -> None:
    config, model = llama
    save_checkpoint(model, tmp_path, shards=1)
    opened: list[str] = []
    real_open = safetensors.safe_open

    def counting_open(filename, *args, **kwargs):
        opened.append(Path(filename).name)
        return real_open(filename, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", counting_open)
    load_block_weights(tmp_path, config, 1)
    assert opened == ["model.safetensors"]
