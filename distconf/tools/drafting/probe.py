"""The one place the drafter builds and runs tiny models.

`tiny_model` builds a tiny config's float32 model; inside `probe_session` (one per `draft_family`) each config is
built once and every caller gets a pristine copy, with torch's global generator as the build left it, so what a
caller sees does not depend on who asked first. `observe` runs one instrumented forward pass (a `Forward`: its
input) and keeps a `ProbeRecord` of every layer call, shared by every rule reading that pass. Each variant's 12-token
run and the checks that need passes of other shapes are in `distconf.tools.drafting.probe_runs` (the two-row
step of a state list, `rows_step_together`, is here).
Whatever a tiny model raises is caught in one place (`_attempt`) and reported by the caller: in the review notes
for a variant's run, in the draft's ``undecided`` notes for a rule's probe (`distconf.tools.drafting.rules`).
`TinyFacts` is what the rules get besides the draft.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from distconf.tools.drafting.common import field_value, is_int, quiet_transformers
from distconf.tools.drafting.scan import find_layer_list, layer_signature

__all__ = ["layer_kinds", "meta_layer_kinds", "MAX_TINY_PARAMETERS", "probe_session", "tiny_model", "Forward",
           "LayerCall", "ProbeRecord", "TinyFacts", "observe", "failed_probes", "rows_step_together", "CACHED_RUN",
           "UNCACHED_RUN"]

MAX_TINY_PARAMETERS = 100_000_000  # a tiny model above this missed a size: it is not built for real
_MAX_VALUES_PER_KIND = 4


@dataclass(frozen=True)
class TinyFacts:
    """What the rules get besides the draft: the tiny config (without its variants) and its config class, and
    what the static scan of the model found that a rule confirms on the probe runs."""

    config_class: type
    tiny: Mapping[str, Any]
    layer_class: type
    vocab_size: Any = None
    stacks: Mapping[str, Any] = field(default_factory=dict)
    """Growing stacks the model's forward passes its layers (`stacks.stack_places`)."""
    owner: str = ""
    """The class name of the module holding the layer list."""
    carried_places: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    """Values carried from layer to layer, not handed by keyword (`carried_streams.carried_places`)."""
    carried_keywords: Mapping[str, Any] = field(default_factory=dict)
    """Values carried from layer to layer by keyword (`streams.carried_keywords`)."""
    attention_by_type: Mapping[str, type] = field(default_factory=dict)
    mixer: type | None = None
    """The layers' cache-taking module when no attention module was found (`state_section.cache_module_class`)."""


def layer_kinds(layers: Any, config: Any) -> set[Hashable]:
    """Kinds of layers: each layer's modules, with its entries in the config's per-layer lists of categories."""
    count = len(layers)
    columns = [v for v in vars(config).values() if _is_category_list(v, count)]
    return {(layer_signature(layer), tuple(column[i] for column in columns)) for i, layer in enumerate(layers)}


def _is_category_list(value: Any, count: int) -> bool:
    """One category per layer: strings, booleans or 0/1 flags, few distinct ones."""
    if not isinstance(value, (list, tuple)) or count < 1 or len(value) != count:
        return False
    if not all(isinstance(x, (str, bool)) for x in value) and not all(x in (0, 1) and is_int(x) for x in value):
        return False
    return len(set(value)) <= _MAX_VALUES_PER_KIND


def _build(config_class: type, tiny: Mapping[str, Any], attn_implementation: str, *, meta: bool) -> tuple[Any, Any]:
    import torch

    from distconf.blocks.hf_compat import causal_lm_from_config, set_attn_implementation

    with quiet_transformers():
        config = config_class(**copy.deepcopy(dict(tiny)))  # classes may normalize lists in place
        set_attn_implementation(config, attn_implementation)
        if meta:
            with torch.device("meta"):
                return config, causal_lm_from_config(config)
        torch.manual_seed(0)
        return config, causal_lm_from_config(config, dtype=torch.float32).eval()


_session: list[dict[Any, Any]] = []
_T = TypeVar("_T")


@dataclass(frozen=True)
class _Failed:
    """What building or running a tiny model raised."""

    error: BaseException

    def __str__(self) -> str:
        return f"{type(self.error).__name__}: {self.error}"


def _attempt(make: Callable[[], _T]) -> _T | _Failed:
    """``make()``, or what it raised. Transformers' code on values it was never run with raises anything (its
    asserts, shape and index errors, missing attributes, its own exception types); a probe never stops the draft
    for it: the caller records or reports the failure."""
    try:
        return make()
    except Exception as exc:  # the probe's one catch-all, see above
        return _Failed(exc)


@contextlib.contextmanager
def probe_session() -> Iterator[None]:
    """Within it, each tiny config is built once and each `Forward` of it is run once."""
    _session.append({})
    try:
        yield
    finally:
        _session.pop()


def _key(*parts: Any) -> Any:
    try:
        return tuple(json.dumps(p, sort_keys=True, default=repr) if isinstance(p, Mapping) else p for p in parts)
    except (TypeError, ValueError):  # keys JSON cannot sort: not cached
        return None


def _cached(key: Any, make: Any) -> Any:
    """``make()``, once per ``key`` within the `probe_session` (every time outside one)."""
    if not _session or key is None:
        return make()
    cache = _session[-1]
    if key not in cache:
        cache[key] = make()
    return cache[key]


def tiny_model(config_class: type, tiny: Mapping[str, Any], attn_implementation: str) -> tuple[Any, Any]:
    """(config, float32 model in eval mode) of the tiny config, with seeded random weights: a copy of the one build
    of the `probe_session`, torch's global generator set as that build left it (raises what the build raises)."""
    import torch

    def build() -> tuple[Any, Any, Any] | _Failed:
        built = _attempt(lambda: _build(config_class, tiny, attn_implementation, meta=False))
        return built if isinstance(built, _Failed) else (*built, torch.get_rng_state())

    built = _cached(_key("model", config_class, tiny, attn_implementation), build)
    if isinstance(built, _Failed):
        raise built.error  # to each caller, as a build of its own would
    config, model, rng = built
    if not _session:
        return config, model
    try:
        copied = copy.deepcopy((config, model))
    except (TypeError, RuntimeError, copy.Error):  # a model holding what cannot be copied is built again
        copied = _build(config_class, tiny, attn_implementation, meta=False)
    torch.set_rng_state(rng)
    return copied


@dataclass(frozen=True)
class Forward:
    """One forward pass of a tiny model: token ids ``[batch, tokens]`` drawn from ``[low, high)`` by torch's global
    generator as the build left it (``seed``: by a generator of that seed; ``ids``: these instead), row 0's first
    ``padded`` tokens masked by an attention_mask (None: no mask), with or without a cache."""

    use_cache: bool
    batch: int = 1
    tokens: int = 5
    low: int = 0
    high: int = 8
    seed: int | None = None
    ids: tuple[tuple[int, ...], ...] | None = None
    padded: int | None = None
    dtype: str = "float32"
    """The model's dtype for this pass (it is built in float32)."""
    quiet: bool = True
    """Silence transformers' warnings (the run whose failures the user reads keeps them)."""

    def describe(self) -> str:
        """The pass in a few words, for a user (``"a 1x5-token float32 forward with a cache"``)."""
        mask = f", {self.padded} padded" if self.padded else ""
        cache = "with" if self.use_cache else "without"
        return f"a {self.batch}x{self.tokens}-token {self.dtype} forward {cache} a cache{mask}"


CACHED_RUN = Forward(use_cache=True)
"""Five token ids with a cache: what the layers get besides the hidden states, which of them run."""
BFLOAT16_RUN = Forward(use_cache=True, tokens=4, dtype="bfloat16", quiet=False)
"""Four token ids through the model in bfloat16, with a cache: the dtypes its states are kept in."""
UNCACHED_RUN = Forward(use_cache=False)
"""Five token ids without a cache: what the layers get and return, and the modules outside them."""


@dataclass
class LayerCall:
    """One call of one layer in a probe run."""

    index: int
    module: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    containers: dict[str, tuple[int, int, type]]
    """Keyword -> (identity, length, class) of the mapping arguments as the call began."""
    lists: dict[str, list[Any]]
    """Keyword -> copies of the tensors of the list (or tuple) arguments as the call began."""
    output: Any = None
    stored: dict[str, Any] = field(default_factory=dict)
    """Keyword -> ``{key: K shape + V last dim}`` of what a mapping argument held after the call (or the error
    reading it raised)."""
    outside_before: int = 0
    """How many outside modules had run when this call returned."""
    io: tuple[Any, Any] | None = None
    """Copies of the hidden states the layer got and of those it returned, as the call returned (None: not
    tensors)."""


@dataclass
class ProbeRecord:
    """What one instrumented forward pass of a tiny model showed: every layer call in order (``calls``), the
    calls of the modules outside the layer list (name, input shape, output shape), and the model's output; or
    ``error`` (``"ExceptionType: message"``), why it did not build or run."""

    config: Any = None
    model: Any = None
    layer_list: str = ""
    layers: Any = ()
    layer_count: int = 0
    input_ids: Any = None
    calls: list[LayerCall] = field(default_factory=list)
    outside: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    result: Any = None
    error: str | None = None
    built: bool = False
    """Whether the model was built (``error`` then says why the forward pass failed)."""

    def of_layer(self, index: int) -> list[LayerCall]:
        """The calls of layer ``index``, in order."""
        return [call for call in self.calls if call.index == index]


def _mapping_summary(value: Any) -> dict[str, tuple[int, ...]]:
    container = value or {}
    return {str(k): (*v[0].shape, v[1].shape[-1]) for k, v in container.items()
            if isinstance(v, (tuple, list)) and len(v) >= 2 and hasattr(v[0], "shape")}


def observe(config_class: type, tiny: Mapping[str, Any], attn_implementation: str, forward: Forward) -> ProbeRecord:
    """The record of ``forward`` on the tiny config's model (once per `probe_session`; a failed one is also listed
    by `failed_probes`)."""
    record = _cached(_key("observe", config_class, tiny, attn_implementation, forward),
                     lambda: _observe(config_class, tiny, attn_implementation, forward))
    if record.error is not None and _session:
        _session[-1].setdefault(_FAILED, []).append((forward, record))
    return record


_FAILED = "failed probe runs"


def failed_probes() -> list[tuple[Forward, ProbeRecord]]:
    """The failed runs `observe` handed out in this `probe_session` since the last call (which clears them)."""
    if not _session:
        return []
    return _session[-1].pop(_FAILED, [])


def _observe(config_class: type, tiny: Mapping[str, Any], attn_implementation: str, forward: Forward) -> ProbeRecord:
    import torch

    record = ProbeRecord()

    def build() -> tuple[Any, Any, str, Any]:
        config, model = tiny_model(config_class, tiny, attn_implementation)
        return (config, model, *find_layer_list(model, field_value(config, "num_hidden_layers")))

    built = _attempt(build)
    if isinstance(built, _Failed):
        record.error = str(built)
        return record
    record.config, record.model, record.layer_list, layers = built
    record.built, record.layers, record.layer_count = True, layers, len(layers)
    open_calls: dict[int, list[LayerCall]] = {}

    def before(index: int) -> Any:
        def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
            call = LayerCall(index, module, tuple(args), dict(kwargs), {
                k: (id(v), len(v), type(v)) for k, v in kwargs.items() if _is_container(v)}, {
                k: [t.detach().clone() for t in v] for k, v in kwargs.items()
                if isinstance(v, (list, tuple)) and v and all(isinstance(t, torch.Tensor) for t in v)})
            record.calls.append(call)
            open_calls.setdefault(index, []).append(call)
        return hook

    def after(index: int) -> Any:
        def hook(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
            call = open_calls[index].pop()
            call.output, call.outside_before = output, len(record.outside)
            hidden = args[0] if args else kwargs.get("hidden_states")
            out = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(hidden, torch.Tensor) and isinstance(out, torch.Tensor):
                call.io = (hidden.detach().clone(), out.detach().clone())
            for name, value in kwargs.items():
                if _is_container(value):
                    try:
                        call.stored[name] = _mapping_summary(value)
                    except (AttributeError, TypeError, IndexError, KeyError) as exc:  # not K/V pairs
                        call.stored[name] = exc  # for the rule reading it: a hook raising ends every rule's run
        return hook

    def outside(name: str) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            if args and isinstance(args[0], torch.Tensor) and isinstance(output, torch.Tensor):
                record.outside.append((name, tuple(args[0].shape), tuple(output.shape)))
        return hook

    handles = [layer.register_forward_pre_hook(before(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles += [layer.register_forward_hook(after(i), with_kwargs=True) for i, layer in enumerate(layers)]
    prefix = record.layer_list
    handles += [module.register_forward_hook(outside(name)) for name, module in record.model.named_modules()
                if name and not (name == prefix or name.startswith(prefix + "."))]
    if forward.ids is not None:
        ids = torch.tensor(forward.ids)
    else:
        shape = (forward.batch, forward.tokens)
        generator = torch.Generator().manual_seed(forward.seed) if forward.seed is not None else None
        ids = torch.randint(forward.low, forward.high, shape, generator=generator)
    record.input_ids = ids
    extra: dict[str, Any] = {}
    if forward.padded is not None:
        extra["attention_mask"] = torch.ones(forward.batch, forward.tokens, dtype=torch.long)
        extra["attention_mask"][0, :forward.padded] = 0

    def run() -> Any:
        if forward.dtype != "float32":
            record.model = record.model.to(getattr(torch, forward.dtype))
        with torch.no_grad(), quiet_transformers() if forward.quiet else contextlib.nullcontext():
            return record.model(ids, use_cache=forward.use_cache, **extra)

    result = _attempt(run)
    for handle in handles:
        handle.remove()
    if isinstance(result, _Failed):
        record.error = str(result)
    else:
        record.result = result
    return record


def _is_container(value: Any) -> bool:
    from collections import UserDict

    return isinstance(value, (Mapping, UserDict)) and not hasattr(value, "shape")


def meta_layer_kinds(config_class: type, tiny: Mapping[str, Any], attn_implementation: str) -> set[Hashable] | None:
    """Kinds of layers of the tiny model built on the meta device (None when it cannot be built)."""
    def kinds() -> set[Hashable] | None:
        def read() -> set[Hashable]:
            config, model = _build(config_class, tiny, attn_implementation, meta=True)
            _, layers = find_layer_list(model, field_value(config, "num_hidden_layers"))
            return layer_kinds(layers, config)

        found = _attempt(read)
        return None if isinstance(found, _Failed) else found  # the real run reports why

    return _cached(_key("meta kinds", config_class, tiny, attn_implementation), kinds)


def rows_step_together(config_class: type, tiny: Mapping[str, Any], attn_implementation: str, name: str) -> bool:
    """Whether the model's one-token step after a state list ``name`` of two rows equals each row's own (some
    layers broadcast their state's rows against their input's in that step); True when it cannot tell."""
    import torch

    generator = torch.Generator().manual_seed(0)
    ids, nxt = torch.randint(0, 8, (2, 4), generator=generator), torch.randint(0, 8, (2, 1), generator=generator)

    def run() -> tuple[Any, list[Any]] | None:
        _, model = tiny_model(config_class, tiny, attn_implementation)
        with torch.no_grad():
            state = model(ids, use_cache=True).get(name)
            rows = [model(nxt[r:r + 1], **{name: model(ids[r:r + 1], use_cache=True).get(name)},
                          use_cache=True).get("logits") for r in range(2)]
            try:
                return model(nxt, **{name: state}, use_cache=True).get("logits"), rows
            except RuntimeError:  # the rows do not broadcast: the step is wrong for several rows
                return None

    ran = _attempt(run)
    if isinstance(ran, _Failed):  # the float32 run has reported anything wrong with the config
        return True
    if ran is None:
        return False
    batched, rows = ran
    expected = torch.cat(rows)
    return batched.shape == expected.shape and torch.allclose(batched, expected, rtol=1e-4, atol=1e-5)
