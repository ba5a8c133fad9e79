"""Step 1 of the check: the Hugging Face reference model of a tiny config, and its hidden states.

The reference is built from the family's HF config class (``cls.hf_config_class``), not
from the distributed class, so it is exactly what transformers does for that config.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distconf.blocks.wire import to_wire_form
from distconf.loader.config_protocol import DistributedConfig
from distconf.tools.checker.failures import located_failure
from distconf.tools.checker.wire_records import batch_first, checked_streams, shared_parts, store_shared

if TYPE_CHECKING:
    from distconf.blocks.wire import CarriedSlot, ModelInputCapture

__all__ = ["SEQ_LEN", "BATCH", "tiny_variants", "Reference", "build_reference", "save_sharded",
           "find_layer_module", "record_layer_io", "perturb_weights"]

SEQ_LEN = 9
"""Tokens per sequence of the reference run."""
BATCH = 2
"""Sequences of the reference run."""
_WEIGHT_NOISE = 0.05  # on top of the initializer, so zero-initialized biases and norms matter too


def tiny_variants(tiny: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Expand a ``tiny_config`` into named variants (``variants`` entries applied on the base)."""
    base = {k: v for k, v in tiny.items() if k != "variants"}
    extra = tiny.get("variants") or []
    if not extra:
        return [("tiny", base)]
    out = []
    for entry in extra:
        name = ",".join(f"{k}={v}" for k, v in entry.items()) or "base"
        out.append((name, {**base, **entry}))
    return out


@dataclass
class Reference:
    """A tiny HF causal LM (float32, eval mode) and the distributed config of the same values."""

    config: DistributedConfig
    model: Any

    @property
    def layers(self) -> int:
        """Decoder layers of the model."""
        return int(self.config.num_hidden_layers)

    @property
    def blocks(self) -> int:
        """Blocks of the model: its layers as the forward pass runs them (more than `layers` for a looped
        layer stack, `distconf.loader.layer_stack`)."""
        from distconf.loader.naming import config_num_blocks

        return config_num_blocks(self.config)

    def layer(self, layer_idx: int) -> Any:
        """The model's decoder layer ``layer_idx`` (found through the family prefix), or None."""
        return find_layer_module(self.model, self.config, layer_idx)


def build_reference(cls: type, values: dict[str, Any]) -> Reference:
    """Build the distributed config and the HF model of ``values`` (random, perturbed weights)."""
    import torch

    from distconf.blocks.hf_compat import causal_lm_from_config

    try:
        config = cls(**values)
        reference_config = cls.hf_config_class(**values)  # type: ignore[attr-defined]
    except Exception as exc:
        raise located_failure(cls, ("tiny_config",), f"cannot build the config: {exc}") from None
    torch.manual_seed(0)
    try:
        model = causal_lm_from_config(reference_config).float().eval()
    except Exception as exc:
        raise located_failure(cls, ("config_class",),
                              f"cannot build a causal LM from the tiny config: {exc}") from None
    perturb_weights(model)
    return Reference(config, model)


def perturb_weights(model: Any) -> None:
    """Add seeded noise to every parameter of ``model``, so zero-initialized biases and norms matter too (and
    no two learned values tie, as in a trained model)."""
    import torch

    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * _WEIGHT_NOISE)


def save_sharded(model: Any, directory: Path) -> None:
    """Save ``model`` as safetensors in about four shards (so prefixes are read across files)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(directory, max_shard_size=max(total // 4, 4096))


def find_layer_module(model: Any, config: DistributedConfig, layer_idx: int) -> Any:
    """The module of ``model`` at the family prefix of layer ``layer_idx``, or None."""
    from distconf.blocks.weights import layer_prefixes

    modules = dict(model.named_modules())
    for prefix in layer_prefixes(config, layer_idx):
        module = modules.get(prefix.rstrip("."))
        if module is not None:
            return module
    return None


def record_layer_io(reference: Reference) -> tuple[Any, list[Any]]:
    """Run the HF model on random tokens; return the first layer's input and every layer's output.

    Each as the blocks exchange it: a layer's ``[batch, seq, streams, hidden]`` flattened for a family whose
    hidden state holds several streams (`distconf.blocks.wire`), followed by the values carried from layer to
    layer (``hidden_state.carried``: the layer's input, zeros for the model's None, and its output).
    """
    import torch

    from distconf.blocks.wire import carried_layout
    from distconf.loader.kv_sharing import shared_kv_slots
    from distconf.loader.spec_wire import stream_axis_of

    layout = carried_layout(reference.config)
    cls = type(reference.config)
    axis = stream_axis_of(reference.config)
    slots = shared_kv_slots(reference.config)
    stored: dict[str, Any] = {}
    capture = _capture(reference, layout)
    records: dict[int, list[tuple[Any, Any]]] = {i: [] for i in range(reference.layers)}
    hooks = []
    for i in range(reference.layers):
        def hook(module: Any, args: Any, kwargs: Any, output: Any, i: int = i) -> None:
            hidden = batch_first(args[0] if args else kwargs["hidden_states"], axis)
            out = batch_first(output[0] if isinstance(output, (tuple, list)) else output, axis)
            if not any(records.values()):  # the streams first: the carried values' checks read the tokens' shape
                checked_streams(reference, hidden, (BATCH, SEQ_LEN))
            inputs = _carried_inputs(module, args, kwargs, layout)
            computed = _computed_inputs(cls, capture, layout, hidden, inputs, i)
            given = _with_carried(hidden, inputs, layout, cls, computed)
            made = _with_carried(out, output, layout, cls, computed, inputs, given, i)
            if slots:  # kv_cache.shared: what the layers stored so far follows, as the wire holds it
                before = shared_parts(stored, slots, hidden)
                store_shared(reference, module, args, kwargs, i, stored, hidden.shape[1])
                given, made = (given[0], [*given[1], *before]), (made[0], [*made[1], *shared_parts(stored, slots,
                                                                                                  hidden)])
            records[i].append((given, made))
        hooks.append(reference.layer(i).register_forward_hook(hook, with_kwargs=True))
    generator = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, reference.config.vocab_size, (BATCH, SEQ_LEN), generator=generator)
    try:
        with torch.no_grad():
            reference.model(input_ids=input_ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    if not any(records.values()):
        raise located_failure(type(reference.config), ("block", "prefix"),
                              "the model called none of the layers at block.prefix in its forward pass")
    _check_stack_growth(cls, records, layout)
    records = _unrolled(reference, records)
    first, outputs = _chain(records, reference.blocks)
    streams = checked_streams(reference, first[0], (BATCH, SEQ_LEN))
    ins, outs = [_wire(first, streams)], [_wire(out, streams) for out in outputs]
    if type(reference.config).family_spec.block.layer_stack is not None:  # type: ignore[attr-defined]
        ins, outs = _with_loop_input(reference, ins, outs)
    return ins[0], outs


def _unrolled(reference: Reference, records: dict[int, list[tuple[Any, Any]]]) -> dict[int, list[tuple[Any, Any]]]:
    """Each block's call, as the family's layer stack says the model runs its layers (each once, or a looped
    range several times: `distconf.loader.layer_stack`); a layer run another number of times fails, located."""
    from distconf.errors import ConfigValueError
    from distconf.loader.layer_stack import block_count, model_layer

    cls = type(reference.config)
    try:
        blocks = block_count(reference.config)
        layers = [model_layer(reference.config, b) for b in range(blocks)]
    except ConfigValueError as exc:
        raise located_failure(cls, ("block", "layer_stack", "loop"), str(exc)) from None
    expected = {i: layers.count(i) for i in range(reference.layers)}
    wrong = [i for i in range(reference.layers) if records[i] and len(records[i]) != expected[i]]
    if wrong:  # hidden states loop back through these layers other than the family file says
        i = wrong[0]
        shown = ", ".join(map(str, wrong[:8])) + ("..." if len(wrong) > 8 else "")
        looped = cls.family_spec.block.layer_stack is not None  # type: ignore[attr-defined]
        raise located_failure(cls, ("block", "layer_stack", "loop") if looped else ("block",),
                              f"{'layers' if len(wrong) > 1 else 'layer'} {shown} of the model "
                              f"{'run' if len(wrong) > 1 else 'runs'} {len(records[i])} times in one forward pass, "
                              f"the family file says {expected[i]}" + ("" if looped else
                              " (a looped layer stack: declare it in block.layer_stack.loop)"))
    seen: dict[int, int] = {}
    unrolled: dict[int, list[tuple[Any, Any]]] = {}
    for block, layer in enumerate(layers):
        calls = records[layer]
        unrolled[block] = [calls[seen.get(layer, 0)]] if calls else []
        seen[layer] = seen.get(layer, 0) + 1
    return unrolled


def _with_loop_input(reference: Reference, ins: list[Any], outs: list[Any]) -> tuple[list[Any], list[Any]]:
    """The wires with the looped stack's input after them: zeros into the first pass, then the hidden state
    that entered it (the output of the block before), as the blocks carry it."""
    import torch

    from distconf.loader.layer_stack import loop_of

    loop = loop_of(reference.config)
    assert loop is not None  # the caller checks the family loops layers
    stack_input = outs[loop.start - 1][..., :_hidden_width(reference)]
    zeros = torch.zeros_like(stack_input)
    ins = [torch.cat([ins[0], zeros], dim=-1)]
    outs = [torch.cat([out, stack_input if block >= loop.start else zeros], dim=-1)
            for block, out in enumerate(outs)]
    return ins, outs


def _hidden_width(reference: Reference) -> int:
    """Values per token of the hidden state on the wire (its streams, without carried values)."""
    from distconf.loader.spec_wire import streams_of

    return streams_of(reference.config) * int(reference.config.hidden_size)


def _check_stack_growth(cls: type, records: dict[int, list[tuple[Any, Any]]],
                        layout: tuple[CarriedSlot, ...]) -> None:
    """Each growing stack after a layer, by the family's rule, is the stack the model hands the next layer."""
    import torch

    for j, slot in enumerate(layout):
        if slot.every is None:
            continue
        for i in range(len(records) - 1):
            if records[i] and records[i + 1] and not torch.equal(records[i][0][1][1][j], records[i + 1][0][0][1][j]):
                raise located_failure(cls, ("hidden_state", "carried", j, "grows", "every"),
                                      f"{slot.argument} after layer {i} is not the stack the model hands layer {i + 1} "
                                      f"(appending the input of every {slot.every}th layer)")


def _carried_inputs(module: Any, args: Any, kwargs: Any, layout: tuple[CarriedSlot, ...]) -> list[Any]:
    """The values ``layout`` names as the model handed them to ``module`` (None where it handed none)."""
    import inspect

    if not layout:
        return []
    bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
    extra = bound.get(next((n for n, p in inspect.signature(module.forward).parameters.items()
                            if p.kind is p.VAR_KEYWORD), ""), {})
    return [bound.get(slot.argument, extra.get(slot.argument)) for slot in layout]


def _capture(reference: Reference, layout: tuple[CarriedSlot, ...]) -> ModelInputCapture | None:
    """A `ModelInputCapture` of the reference model's ``computed_by`` methods (None: the family has none)."""
    from distconf.blocks.wire import ModelInputCapture

    if not any(slot.computed_by for slot in layout):
        return None
    try:
        return ModelInputCapture(reference.model, layout)
    except ValueError as exc:
        index = next(k for k, slot in enumerate(layout) if slot.computed_by)
        raise located_failure(type(reference.config), ("hidden_state", "carried", index, "computed_by"),
                              str(exc)) from None


def _computed_inputs(cls: type, capture: ModelInputCapture | None, layout: tuple[CarriedSlot, ...], hidden: Any,
                     handed: list[Any], layer_idx: int) -> dict[str, Any]:
    """``{argument: every layer's part}`` of the ``computed_by`` values, as their methods returned them; each
    checked to hold, at layer ``layer_idx``'s part, what the model ``handed`` that layer."""
    import torch

    if capture is None:
        return {}
    found = {}
    for index, (slot, value) in enumerate(zip(layout, handed, strict=True)):
        if slot.computed_by is None:
            continue
        where = ("hidden_state", "carried", index, "computed_by")
        try:
            whole = capture.value(slot, hidden.flatten(2) if hidden.ndim > 3 else hidden)
        except ValueError as exc:
            raise located_failure(cls, where, str(exc)) from None
        part = slot.layer_part(whole, layer_idx)
        if not isinstance(value, torch.Tensor) or value.shape != part.shape or not torch.equal(value, part):
            shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise located_failure(cls, where, f"layer {layer_idx} got {slot.argument} {shape}, not its part "
                                  f"[..., {layer_idx}, :] of what {slot.computed_by} returned")
        found[slot.argument] = whole.detach().clone()
    return found


def _with_carried(hidden: Any, values: Any, layout: tuple[CarriedSlot, ...], cls: type,
                  computed: dict[str, Any], inputs: list[Any] | None = None, given: tuple[Any, list[Any]] | None = None,
                  layer_idx: int = 0) -> tuple[Any, list[Any]]:
    """``hidden`` and the carried values (from a layer's inputs in order, or its output tuple at their indices;
    ``computed``, every layer's part, for a ``computed_by`` value; a value the layer does not return from
    ``inputs``), as the wire holds them; a growing stack as the wire holds it (`stack_on_wire`), after a layer the
    stack it was ``given`` grown by the loop's rule (the next layer's input is the model's own: a wrong rule
    differs there)."""
    from distconf.blocks.wire import carried_wire_value, grow_stack, stack_on_wire

    hidden = hidden.detach().clone()
    if not layout:
        return hidden, []
    if not isinstance(values, list):  # a layer's output tuple
        values = [(inputs or [None] * len(layout))[n] if slot.output_index is None
                  else values[slot.output_index]
                  if isinstance(values, (tuple, list)) and len(values) > slot.output_index else None
                  for n, slot in enumerate(layout)]
    carried = []
    like = hidden.new_zeros(*hidden.shape[:2], 1)
    for j, (slot, value) in enumerate(zip(layout, values, strict=True)):
        if slot.every is not None:
            try:
                if given is None:
                    carried.append(stack_on_wire(value, slot, hidden if hidden.ndim == 3 else hidden.flatten(-2)))
                else:
                    layer_input = given[0] if given[0].ndim == 3 else given[0].flatten(-2)
                    carried.append(grow_stack(given[1][j], slot, layer_idx, layer_input))
            except ValueError as exc:
                raise located_failure(cls, ("hidden_state", "carried"), f"layer {layer_idx}: {exc}") from None
            continue
        if slot.computed_by is not None:
            value = computed[slot.argument]
        if value is not None and not slot.token_ids and value.shape[-1] != slot.width:
            raise located_failure(cls, ("hidden_state", "carried"), f"the model carries {slot.argument} of "
                                  f"{list(value.shape)}, not {slot.width} values per token")
        try:
            carried.append(carried_wire_value(slot, None if value is None else value.detach().clone(), like))
        except ValueError as exc:
            raise located_failure(cls, ("hidden_state", "carried"), str(exc)) from None
    return hidden, carried


def _wire(record: tuple[Any, list[Any]], streams: int) -> Any:
    """A recorded hidden state and its carried values as the wire holds them."""
    import torch

    hidden, carried = record
    wire = to_wire_form(hidden, streams)
    return torch.cat([wire, *carried], dim=-1) if carried else wire


def _chain(records: dict[int, list[tuple[Any, Any]]], layers: int) -> tuple[Any, list[Any]]:
    """The first layer's input and every layer's output; a layer the model skipped (e.g. a cross-attention layer
    given no image input) passes its input on, which is what its block must do too."""
    hidden = next(records[i][0][0] for i in range(layers) if records[i])
    first, outputs = hidden, []
    for i in range(layers):
        if records[i]:
            hidden = records[i][0][1]
        outputs.append(hidden)
    return first, outputs
