"""`AutoDistributedModelForCausalLM`: a family's Hugging Face causal LM whose blocks run on the swarm.

The model is the family's own transformers class (``MODEL_FOR_CAUSAL_LM_MAPPING`` of
``cls.hf_config_class``), built on the meta device. Its decoder-layer list (found through
the family file's ``block.prefix``) is replaced by one stand-in module that runs all
blocks remotely; only the other modules (embeddings, final norm, LM head, rotary
tables) are materialized, and only their tensors are read from the checkpoint (through
`distconf.blocks.checkpoint.Checkpoint`, with its file checks; a tensor shared by tied
modules is read once). Nothing here knows a family: the layer list, the checkpoint names
and the way a layer's output is consumed are found from the spec and the model itself.

The config's ``PTuneConfig`` adds trainable prompts (`distconf.client.ptune`): the only
trainable parameters of the model. ``LMHeadConfig`` picks the LM head's forward
(`distconf.client.lmhead`). ``save_pretrained`` writes the config and the client-side
tensors, trained prompts included; ``from_pretrained`` on that folder loads them back.
``from_pretrained`` takes any model source (`distconf.client.model_source`): a Hugging Face
folder as it is, a GGUF file, a cached hub id; a source that cannot be used raises
`distconf.sources.ModelSourceError`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from distconf.blocks.checkpoint import BlockWeightsError, Checkpoint
from distconf.blocks.hf_compat import causal_lm_class, record_as_decoder_layer, untie_layer_list
from distconf.client.cache import RemoteCache
from distconf.client.hf_generation import RemoteCacheGenerationMixin, layer_output_is_tuple
from distconf.client.layer_fit import (
    carried_arguments,
    check_collapse_module,
    decoder_layer_list,
    hand_final_stacks,
    model_input_capture,
    plain_attributes,
)
from distconf.client.lmhead import install_lm_head
from distconf.client.local_weights import load_non_block_weights, load_prompts
from distconf.client.model_source import ClientSource, open_client_source
from distconf.client.ptune import PromptTuning, prompt_tuning_for
from distconf.client.remote_layers import RemoteLayers
from distconf.client.sequential import RemoteSequential
from distconf.client.swarm import SwarmClient
from distconf.client.verifier import VerificationRollback
from distconf.client.verify_events import VerificationEvent
from distconf.loader.auto import AutoDistributedConfig
from distconf.loader.config_protocol import DistributedConfig
from distconf.loader.naming import config_num_blocks
from distconf.loader.once import OncePerKey
from distconf.loader.spec import FamilySpec
from distconf.loader.wire_layout import wire_layout
from distconf.sources import ModelSource, ModelSourceError
from distconf.sources.hub_fetch import HubOptions

__all__ = ["AutoDistributedModelForCausalLM", "DistributedCausalLMMixin", "PROMPTS_ATTRIBUTE", "RemoteLayers",
           "distributed_model_class"]

#: Where a model holds its `PromptTuning` (so its tensors are saved as ``ptune.*``).
PROMPTS_ATTRIBUTE = "ptune"

_classes: OncePerKey[type, type] = OncePerKey()
_MAX_RESTARTS = 4  # generations started over after a server was caught (each bans one more server)
logger = logging.getLogger(__name__)


class DistributedCausalLMMixin(RemoteCacheGenerationMixin):
    """What a distributed causal LM adds to its transformers class: the swarm, sessions, generate."""

    remote_layers: RemoteLayers
    _created_caches: list[RemoteCache]

    @property
    def remote(self) -> RemoteSequential:
        """The blocks on the swarm (`RemoteSequential`)."""
        return self.remote_layers.remote

    @property
    def prompts(self) -> PromptTuning | None:
        """The trained prompts (``config.tuning_mode``), or None."""
        return getattr(self, PROMPTS_ATTRIBUTE, None)

    def inference_session(self, max_length: int, adapter: str | None = None) -> RemoteCache:
        """A remote session usable as ``generate(..., cache=session)``; close it (or ``with``) when done.

        ``max_length`` counts the user's tokens; the session also holds the prompt positions. ``adapter``: the
        LoRA adapter the servers apply for this session (None: ``config.active_adapter``, Petals' field).
        """
        return RemoteCache(self.remote, max_length, config_num_blocks(self.config), prompts=self.prompts,
                           adapter=adapter)

    @property
    def verification_events(self) -> list[VerificationEvent]:
        """Servers caught computing wrong by spot checks (``verify_fraction``), oldest first."""
        return self.remote.verifier.events

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Hugging Face ``generate`` (greedy, sampling, beam search, ...) through the swarm.

        With spot checks on and no ``cache`` given, the result is checked in full before it
        is returned; when a server is caught, generation starts over without it (a streamer
        then sees the tokens again). With a ``cache`` of your own, `VerificationRollback`
        tells you where it went back to.
        """
        mask = kwargs.get("attention_mask")
        if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
            raise ValueError("padding is not supported by the Petals 2.x protocol: give prompts of equal length "
                             "(attention_mask must be all ones)")
        ids = args[0] if args else kwargs.get("input_ids")
        assisted = kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens")
        if assisted and ids is not None and ids.shape[0] > 1:
            return self._generate_rows(ids, {k: v for k, v in kwargs.items() if k != "input_ids"})
        verifier = getattr(self.remote, "verifier", None)  # a stand-in for the swarm may have none
        checked = verifier is not None and verifier.enabled and kwargs.get("cache") is None
        restarts = _MAX_RESTARTS if checked else 0
        for attempt in range(restarts + 1):
            created_before = len(self._created_caches)
            try:
                result = super().generate(*args, **kwargs)
                for cache in self._created_caches[created_before:] if checked else ():
                    cache.verify()
                return result
            except VerificationRollback as rollback:
                if attempt == restarts:
                    raise
                logger.warning("generation starts over without the server caught (%d of at most %d): %s",
                               attempt + 1, restarts, rollback)
            finally:
                for cache in self._created_caches[created_before:]:
                    cache.close()
                del self._created_caches[created_before:]
        raise AssertionError("unreachable")

    def _generate_rows(self, ids: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        """Assisted generation of several rows: each row on its own session, all at once (transformers' assisted
        generation takes one row), so each keeps its own accepted length; the servers batch the sessions.
        Rows that end early are padded with the pad token (else the first end-of-sequence token)."""
        from concurrent.futures import ThreadPoolExecutor

        row_kwargs = {k: (v[:1] if k == "attention_mask" else v) for k, v in kwargs.items()}
        new = kwargs.get("max_new_tokens")
        longest = ids.shape[1] + new if new is not None else int(kwargs.get("max_length")
                                                                  or self.generation_config.max_length)
        size = longest + 1 + int(kwargs.get("prompt_lookup_num_tokens") or 0)  # the last check of candidates

        def row(i: int) -> torch.Tensor:
            with self.inference_session(size) as cache:  # a cache of its own: rows never share the list of created ones
                return self.generate(ids[i:i + 1], **row_kwargs, cache=cache)

        with ThreadPoolExecutor(ids.shape[0], thread_name_prefix="distconf-assisted-row") as pool:
            rows = list(pool.map(row, range(ids.shape[0])))
        pad = row_kwargs.get("pad_token_id", self.generation_config.pad_token_id)
        if pad is None:
            eos = self.generation_config.eos_token_id
            pad = eos[0] if isinstance(eos, (list, tuple)) else (eos if eos is not None else 0)
        width = max(r.shape[1] for r in rows)
        return torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1]), value=int(pad)) for r in rows])

    def shutdown(self) -> None:
        """Close the connection to the swarm (the DHT node this model started)."""
        self.remote.swarm.shutdown()


def distributed_model_class(config_cls: type) -> type:
    """``Distributed<Name>ForCausalLM``: the family's transformers causal LM plus `DistributedCausalLMMixin`."""
    return _classes.get(config_cls, lambda: _synthesize_model_class(config_cls))


def _synthesize_model_class(config_cls: type) -> type:
    base = causal_lm_class(config_cls.hf_config_class)
    if base is None:
        raise TypeError(f"transformers has no causal-LM class for {config_cls.hf_config_class.__name__}")
    name = config_cls.__name__.removesuffix("Config") + "ForCausalLM"
    return type(name, (DistributedCausalLMMixin, base), {"__module__": __name__, "__qualname__": name,
                                                         "config_class": config_cls})


class AutoDistributedModelForCausalLM:
    """Loads the distributed causal LM of any supported family from any model source."""

    def __init__(self) -> None:
        raise TypeError("use AutoDistributedModelForCausalLM.from_pretrained(...)")

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike[str] | ModelSource | ClientSource, *, dht: Any = None,
                        dtype: torch.dtype | str | None = None, dht_prefix: str | None = None,
                        revision: str | None = None, cache_dir: str | os.PathLike[str] | None = None,
                        gguf_cache_dir: str | os.PathLike[str] | None = None, token: str | None = None,
                        **config_kwargs: Any) -> Any:
        """Build the model of ``model_dir`` with its blocks on the swarm.

        :param model_dir: any model source (see `distconf.client.model_source.open_client_source`):
            a Hugging Face model folder as it is (``config.json`` with or without ``dht_prefix``,
            safetensors), a folder written by the model's ``save_pretrained`` (which holds the
            trained prompts too), a ``.gguf`` file or a folder holding one (converted once into
            a cache; the non-block tensors and the tokenizer are read from the converted copy),
            or a hub id already in the local Hugging Face cache.
        :param dht: a running ``hivemind.DHT`` to reuse (default: start a client-mode node).
        :param dtype: dtype of the local modules and hidden states (default: float32).
        :param dht_prefix: the prefix of the model's blocks on the DHT (default: ``config.json``'s,
            else derived by the family's rule from the model's name, as the servers do).
        :param revision: for a hub id, the revision (branch, tag or commit) to download or read from the cache.
        :param cache_dir: the Hugging Face cache holding hub ids (default: huggingface_hub's).
        :param token: for a private or gated hub id (default: ``HF_TOKEN`` or your huggingface_hub login).
        :param gguf_cache_dir: where GGUF files are converted to (see `distconf.sources.gguf_cache`).
        :param config_kwargs: config fields, e.g. ``initial_peers`` and any other ClientConfig
            field (``ban_timeout``, ``use_server_to_server``, ...), ``tuning_mode``/``pre_seq_len``
            (prompt tuning) or the LM head's settings.
        :raises ModelSourceError: the source cannot be used (named, with the reason).
        """
        hub = HubOptions(revision=revision, token=token, cache_dir=os.fspath(cache_dir) if cache_dir else None)
        source = open_client_source(model_dir, dht_prefix=dht_prefix, cache_dir=gguf_cache_dir, hub=hub)
        config = AutoDistributedConfig.from_pretrained(str(source.folder), **source.config_kwargs(), **config_kwargs)
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else (dtype or torch.float32)
        config.dtype = dtype
        with _open_checkpoint(source) as checkpoint:
            swarm = SwarmClient(config, dht=dht)
            try:
                return build_model(config, checkpoint, swarm, dtype)
            except BaseException as exc:
                swarm.shutdown()
                if isinstance(exc, BlockWeightsError):  # a tensor that cannot be read: the source is at fault
                    raise ModelSourceError(source.name, f"its weights cannot be read: {exc}") from None
                raise


def _open_checkpoint(source: ClientSource) -> Checkpoint:
    """The source's safetensors checkpoint, opened before the swarm is joined (errors named)."""
    try:
        return Checkpoint(source.folder)
    except FileNotFoundError as exc:
        raise ModelSourceError(source.name, f"no weights: {exc}") from None
    except BlockWeightsError as exc:
        raise ModelSourceError(source.name, f"its weights cannot be read: {exc}") from None


def base_model_name(spec: FamilySpec) -> str:
    """The module of the causal LM that runs the layer loop: ``block.base_model_prefix``, else the first part
    of ``block.prefix`` (transformers' causal LMs hold their base model as one attribute, e.g. ``model``,
    ``transformer``, whatever their class's ``base_model_prefix`` says); "" when the layers sit at the top."""
    if spec.block.base_model_prefix:
        return str(spec.block.base_model_prefix)
    head, dot, _ = spec.block.prefix.partition(".")
    return head if dot else ""


def build_model(config: DistributedConfig, checkpoint: Checkpoint, swarm: SwarmClient, dtype: torch.dtype) -> Any:
    """The distributed model of ``config``: non-block modules loaded from ``checkpoint``, layer list replaced."""
    if type(config).family_spec.block.layer_stack is not None:
        raise type(config).family_source.error(
            ("block", "layer_stack"), "the client does not run a looped layer stack yet (the model's own forward "
            "would enter every pass again after the blocks); its blocks are served and checked")
    model_cls = distributed_model_class(type(config))
    with torch.device("meta"):
        model = model_cls(config)
    name, layers = decoder_layer_list(model, config)
    check_collapse_module(model, config)
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    stand_in = RemoteLayers(RemoteSequential(config, swarm), plain_attributes(layers[0]), wire_layout(config),
                            carried_arguments(layers[0], config), model_input_capture(model, config))
    record_as_decoder_layer(stand_in)  # output_hidden_states: the blocks' input and output
    setattr(parent, attr, torch.nn.ModuleList([stand_in]))
    untie_layer_list(model, name)  # the model's ties between its layers name layers that are not here
    model.remote_layers = stand_in
    model._created_caches = []
    hand_final_stacks(model, config, stand_in)
    model.to_empty(device="cpu")
    model.tie_weights()
    load_non_block_weights(model, config, checkpoint)
    model.initialize_weights()  # only what the checkpoint did not give: non-persistent buffers
    model.to(dtype)
    model.eval()
    model.requires_grad_(False)
    install_lm_head(model, config)
    prompts = prompt_tuning_for(config, model.get_input_embeddings())
    if prompts is not None:
        setattr(model, PROMPTS_ATTRIBUTE, prompts)  # trainable, float32
        load_prompts(prompts, checkpoint, PROMPTS_ATTRIBUTE)
    stand_in.use_prompts(prompts)
    layer_output_is_tuple(model.get_submodule(base_model_name(type(config).family_spec)), stand_in,
                          config.hidden_size)
    return model


