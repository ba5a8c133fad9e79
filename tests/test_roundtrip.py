"""The synthesized classes behave like hand-written ones: isinstance, save/load, pickle, spawn, Auto."""

from __future__ import annotations

import copy
import multiprocessing
import pickle

import pytest
import transformers

from distconf import AutoDistributedConfig, FamilyNotFoundError, load_family
from distconf.loader.mixins import ClientConfig, LMHeadConfig, PTuneConfig

BASES = {
    "bloom": transformers.BloomConfig, "llama": transformers.LlamaConfig,
    "falcon": transformers.FalconConfig, "mixtral": transformers.MixtralConfig,
}
NON_DEFAULT_MIXIN_VALUES = {
    "initial_peers": ["/ip4/127.0.0.1/tcp/31337/p2p/QmTest"],
    "dht_prefix": "custom-prefix",
    "daemon_startup_timeout": 12.5,
    "show_route": True,
    "allowed_servers": ["peerA"],
    "blocked_servers": ["peerB"],
    "use_server_to_server": False,
    "connect_timeout": 7,
    "request_timeout": 99,
    "update_period": 30,
    "max_retries": 4,
    "min_backoff": 2,
    "max_backoff": 20,
    "ban_timeout": 5,
    "active_adapter": "my-adapter",
    "max_pinged": 9,
    "ping_timeout": 1.5,
    "pre_seq_len": 16,
    "tuning_mode": "deep_ptune",
    "use_chunked_forward": False,
    "chunked_forward_step": 1024,
}


@pytest.mark.parametrize("family", sorted(BASES))
def test_class_shape(family: str) -> None:
    cls = load_family(family)
    assert cls.__name__ == f"Distributed{family.capitalize()}Config"
    assert cls.__module__ == "distconf.loader.registry"
    bases = [b for b in cls.__bases__ if b.__name__ != "PinnedRevisionMixin"]
    assert bases == [BASES[family], ClientConfig, PTuneConfig, LMHeadConfig]
    cfg = cls()
    assert isinstance(cfg, BASES[family]) and isinstance(cfg, transformers.PreTrainedConfig)
    assert cfg.model_type == BASES[family].model_type
    assert cls.block_prefix == cls.family_spec.block.prefix
    assert cls.attn_class.__name__.endswith("Attention")
    assert isinstance(cfg.num_key_value_groups, int)


@pytest.mark.slow
def test_block_and_attention_classes_are_lazy() -> None:
    import subprocess
    import sys

    code = (
        "import sys, transformers, distconf\n"
        "cls = distconf.load_family('falcon')\n"
        "assert 'transformers.models.falcon.modeling_falcon' not in sys.modules\n"
        "assert cls.attn_class.__name__ == 'FalconAttention'\n"
        "assert 'transformers.models.falcon.modeling_falcon' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("family", sorted(BASES))
def test_save_load_keeps_every_mixin_field(tmp_path, family: str) -> None:
    cls = load_family(family)
    cfg = cls(**NON_DEFAULT_MIXIN_VALUES)
    cfg.save_pretrained(tmp_path)
    loaded = cls.from_pretrained(tmp_path)
    for name, value in NON_DEFAULT_MIXIN_VALUES.items():
        assert getattr(loaded, name) == value, name
    assert type(loaded) is cls
    auto = AutoDistributedConfig.from_pretrained(tmp_path)
    assert type(auto) is cls and auto.dht_prefix == "custom-prefix"


@pytest.mark.parametrize("family", sorted(BASES))
def test_defaults_of_mixins(family: str) -> None:
    cfg = load_family(family)()
    assert cfg.initial_peers == [] and cfg.dht_prefix is None and cfg.show_route == "inference"
    assert (cfg.daemon_startup_timeout, cfg.connect_timeout, cfg.request_timeout) == (60, 5, 180)
    assert (cfg.update_period, cfg.min_backoff, cfg.max_backoff, cfg.ban_timeout) == (60, 1, 60, 15)
    assert (cfg.max_pinged, cfg.ping_timeout, cfg.max_retries) == (3, 2, None)
    assert cfg.use_server_to_server is True and cfg.allowed_servers is None and cfg.blocked_servers is None
    assert (cfg.pre_seq_len, cfg.tuning_mode) == (0, None)
    assert (cfg.use_chunked_forward, cfg.chunked_forward_step) == ("auto", 16384)


def test_initial_peers_from_env(monkeypatch) -> None:
    monkeypatch.setenv("DISTCONF_INITIAL_PEERS", "/ip4/127.0.0.1/tcp/1/p2p/QmA, /ip4/127.0.0.1/tcp/2/p2p/QmB")
    cfg = load_family("llama")()
    assert cfg.initial_peers == ["/ip4/127.0.0.1/tcp/1/p2p/QmA", "/ip4/127.0.0.1/tcp/2/p2p/QmB"]


@pytest.mark.parametrize("family", sorted(BASES))
def test_pickle_and_copy_in_process(family: str) -> None:
    cfg = load_family(family)(**NON_DEFAULT_MIXIN_VALUES)
    for clone in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg), copy.copy(cfg)):
        assert type(clone) is type(cfg)
        assert clone.to_dict() == cfg.to_dict()
    assert pickle.loads(pickle.dumps(type(cfg))) is type(cfg)


def _child_roundtrip(payload: bytes, queue) -> None:
    cfg = pickle.loads(payload)
    queue.put((type(cfg).__module__, type(cfg).__name__, cfg.dht_prefix, cfg.num_key_value_groups,
               pickle.dumps(cfg)))


@pytest.mark.slow
def test_pickle_in_spawned_process() -> None:
    cls = load_family("falcon")
    cfg = cls(num_attention_heads=8, num_kv_heads=2, new_decoder_architecture=True, hidden_size=64,
              dht_prefix="spawned")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_roundtrip, args=(pickle.dumps(cfg), queue))
    proc.start()
    try:
        module, name, prefix, groups, back = queue.get(timeout=120)
    finally:
        proc.join(timeout=30)
    assert (module, name, prefix, groups) == ("distconf.loader.registry", "DistributedFalconConfig", "spawned", 4)
    assert pickle.loads(back).to_dict() == cfg.to_dict()


def test_auto_dispatch_by_model_type(tmp_path) -> None:
    for family, base in BASES.items():
        folder = tmp_path / family
        base(num_hidden_layers=3).save_pretrained(folder)
        cfg = AutoDistributedConfig.from_pretrained(folder)
        assert type(cfg) is load_family(family)
        assert cfg.num_hidden_layers == 3


def test_auto_unknown_model_type_lists_families(tmp_path) -> None:
    transformers.GPT2Config().save_pretrained(tmp_path)
    with pytest.raises(FamilyNotFoundError) as info:
        AutoDistributedConfig.from_pretrained(tmp_path)
    message = str(info.value)
    assert "gpt2" in message
    for family in BASES:
        assert family in message


def test_block_uids() -> None:
    cfg = load_family("llama")(num_hidden_layers=4, dht_prefix="m")
    assert cfg.block_uids() == ["m.0", "m.1", "m.2", "m.3"]
    assert cfg.block_uids(1, 3) == ["m.1", "m.2"]
