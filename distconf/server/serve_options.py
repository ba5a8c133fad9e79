"""What ``distconf serve`` takes (`ServeOptions`): the model source, the span, memory and precision, the network
flags (Petals' names), timeouts, batching, integrity and balancing."""

from __future__ import annotations

from dataclasses import dataclass, field

from distconf.dht.addresses import NetworkOptions
from distconf.sources.hub_fetch import HubOptions

__all__ = ["ServeOptions"]


@dataclass
class ServeOptions:
    """What ``distconf serve`` takes (timeouts in seconds; memory in bytes or ``"24GiB"``).

    ``model_dir`` is any model source `distconf.sources.open_source` opens (a folder, a
    ``.gguf``, a cached hub id); ``dht_prefix`` overrides its prefix. ``dtype``, ``device``
    and ``quant`` are resolved by `distconf.blocks.device` (``quant`` None: nf4 on CUDA, none
    elsewhere). With no ``blocks``, ``num_blocks`` or ``memory`` the server sizes itself from
    the memory available on its device.
    """

    model_dir: str
    dht_prefix: str | None = None
    initial_peers: list[str] = field(default_factory=list)
    new_swarm: bool = False
    blocks: tuple[int, int] | None = None
    num_blocks: int | None = None
    memory: int | str | None = None
    dtype: str = "auto"
    device: str = "auto"
    quant: str | None = None
    host: str | None = None  # one listen address; None: see distconf.dht.addresses (loopback unless networked)
    port: int = 0
    host_maddrs: tuple[str, ...] | None = None  # Petals' --host_maddrs
    announce_maddrs: tuple[str, ...] | None = None  # Petals' --announce_maddrs
    public_ip: str | None = None  # Petals' --public_ip (needs port)
    identity_path: str | None = None  # Petals' --identity_path: a stable peer id (the key is made on first start)
    use_relay: bool = True  # Petals' --no_relay turns it off
    use_auto_relay: bool = True  # Petals' --no_auto_relay turns it off
    reachability_check: bool = True  # Petals' --skip_reachability_check turns it off
    compression: str = "NONE"  # Petals' --compression: hivemind's compression of the hidden states on the wire
    public_name: str | None = None
    update_period: float | None = None
    request_timeout: float = 180.0
    session_timeout: float = 1800.0
    step_timeout: float = 300.0
    max_alloc_timeout: float = 600.0
    inference_max_length: int | None = None
    attn_cache_tokens: int | None = None
    repository: str | None = None
    compute_threads: int | None = None
    max_batch_size: int = 16  # rows of several sessions' inference steps computed together; 1 = no batching
    max_batch_tokens: int | None = None  # rows x padded new tokens per batch (default: the planner's max length)
    prefill_chunk: int = 64  # a longer step is computed in chunks of this many tokens per row
    max_batch_wait: float = 0.04  # seconds a batch may wait for steady sessions' steps that are due
    verify_weights: bool = False  # hash the served weights after loading and at stop; log whether they changed
    block_digests: bool = True  # announce each served block's weights sha256 in rpc_info (``block_sha256``)
    balance_quality: float = 0.75  # Petals' --balance_quality: move when the swarm gets > 1/q faster; 0 = never
    mean_balance_check_period: float = 60.0  # mean seconds between balance checks (uniform in 0..2x, as Petals)
    max_forward_tokens: int | None = None  # batch x length of one forward/backward (default: `default_forward_tokens`)
    max_peer_cache_share: float = 0.5  # fraction of the cache budget one peer's sessions may hold together
    adapters: tuple[str, ...] = ()  # Petals' --adapters: LoRA adapter folders or hub ids (NAME=SOURCE to rename)
    revision: str | None = None  # Petals' --revision: of a hub id (and of hub adapters)
    token: str | None = None  # Petals' --token: for private or gated hub ids (default HF_TOKEN)
    cache_dir: str | None = None  # Petals' --cache_dir: the Hugging Face cache downloads go to
    max_disk_space: int | None = None  # Petals' --max_disk_space: bytes the cache may hold (LRU files evicted)

    @property
    def hub(self) -> HubOptions:
        """The hub options of ``model_dir`` (and hub adapters)."""
        return HubOptions(revision=self.revision, token=self.token, cache_dir=self.cache_dir,
                          max_disk_space=self.max_disk_space)

    @property
    def network(self) -> NetworkOptions:
        """The network flags, as `distconf.dht.addresses` and the reachability check take them."""
        return NetworkOptions(host=self.host, port=self.port, host_maddrs=self.host_maddrs,
                              announce_maddrs=self.announce_maddrs, public_ip=self.public_ip,
                              identity_path=self.identity_path, use_relay=self.use_relay,
                              use_auto_relay=self.use_auto_relay, reachability_check=self.reachability_check)
