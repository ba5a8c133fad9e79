"""How the reference run's layer records become what the blocks exchange: several streams, K/V shared on the wire.

A layer's hidden state of streams first (``hidden_state.stream_axis`` 0) is kept as ``[batch, seq, streams,
hidden]`` (`batch_first`) and the declared streams are checked against the run (`checked_streams`); with
``kv_cache.shared`` the K/V each storing layer put in the model's container follows, as the wire holds it
(`store_shared`, `shared_parts`).
"""

from __future__ import annotations

from typing import Any

from distconf.tools.checker.failures import located_failure

__all__ = ["batch_first", "checked_streams", "shared_parts", "store_shared"]


def shared_parts(stored: dict[str, Any], slots: tuple[Any, ...], like: Any) -> list[Any]:
    """The shared K/V of every slot as the wire holds it: what a layer stored so far, zeros for the rest."""
    return [stored[slot.key].clone() if slot.key in stored else like.new_zeros(*like.shape[:2], slot.width)
            for slot in slots]


def store_shared(reference: Any, module: Any, args: Any, kwargs: Any, layer_idx: int,
                  stored: dict[str, Any], seq: int) -> None:
    """After layer ``layer_idx`` ran: the K/V it stored for later layers, if it stores (``kv_cache.shared``)."""
    import inspect

    from distconf.blocks.shared_kv import stored_part
    from distconf.loader.kv_sharing import layer_sharing, shared_kv_slots

    cls = type(reference.config)
    role, key = layer_sharing(reference.config, layer_idx)
    if role != "store":
        return
    argument = cls.family_spec.kv_cache.shared.argument  # type: ignore[attr-defined]
    container = kwargs.get(argument)
    if container is None:
        container = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments.get(argument)
    width = next(slot.width for slot in shared_kv_slots(reference.config) if slot.key == key)
    try:
        stored[key] = stored_part(container, key, seq, width).detach().clone()  # type: ignore[arg-type]
    except ValueError as exc:
        where = ("kv_cache", "shared", "values_per_token") if "values_per_token" in str(exc) else ("kv_cache", "shared")
        raise located_failure(cls, where, f"layer {layer_idx}: {exc}") from None


def batch_first(hidden: Any, axis: int) -> Any:
    """A layer's hidden state of streams first (``stream_axis`` 0: ``[streams, batch, seq, hidden]``) as
    ``[batch, seq, streams, hidden]``, the form the records keep; anything else as it is."""
    return hidden.movedim(0, 2) if axis == 0 and getattr(hidden, "ndim", 0) == 4 else hidden


def _streams_in(shape: tuple[int, ...], hidden: int, tokens: tuple[int, int]) -> tuple[int, int]:
    """``(streams, axis)`` of a layer input of ``shape`` from a reference run on ``tokens`` (batch, seq)."""
    if len(shape) == 4 and shape[-1] == hidden:
        if shape[:2] == tokens:
            return shape[2], 2
        if shape[1:3] == tokens:
            return shape[0], 0
    return 1, 2


def checked_streams(reference: Any, first: Any, tokens: tuple[int, int]) -> int:
    """The streams the family declares (``hidden_state``), checked against the first layer's input (as the
    records keep it: `batch_first`)."""
    from distconf.loader.spec_wire import stream_axis_of, streams_of

    cls = type(reference.config)
    declared = streams_of(reference.config)
    hidden = int(reference.config.hidden_size)
    seen, axis = _streams_in(tuple(first.shape), hidden, tokens)
    shape = "x".join(map(str, first.shape))
    if declared != seen:
        if cls.family_spec.hidden_state is None:  # type: ignore[attr-defined]
            where = "" if axis == 2 else ", streams first: stream_axis 0"
            raise located_failure(cls, ("hidden_state",), f"the model's layers take a {shape} hidden state ({seen} "
                                  f"streams of hidden_size{where}): declare hidden_state (streams, collapse_module)")
        raise located_failure(cls, ("hidden_state", "streams"), f"gives {declared} streams, but the model's layers "
                              f"take a {shape} hidden state ({seen} streams of hidden_size {hidden})")
    if seen > 1 and axis != 2:  # the records hold [batch, seq, streams, hidden] when the family's axis is right
        raise located_failure(cls, ("hidden_state", "stream_axis"), f"is {stream_axis_of(reference.config)}, but "
                              f"the model's layers take a {shape} hidden state (streams first: stream_axis 0)")
    hidden_state = cls.family_spec.hidden_state  # type: ignore[attr-defined]
    if hidden_state is not None and hidden_state.collapse_module is not None:
        try:
            reference.model.get_submodule(hidden_state.collapse_module)
        except AttributeError:
            raise located_failure(cls, ("hidden_state", "collapse_module"),
                                  f"{type(reference.model).__name__} has no module "
                                  f"{hidden_state.collapse_module!r}") from None
    return declared
