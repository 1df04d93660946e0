"""Walking a causal LM layer by layer, the part every calibration driver shares.

:func:`decoder_layers` finds the decoder layers; :func:`catch_layer0_inputs`
runs the embeddings and stops at layer 0's input; :func:`advance` runs a
layer over the calibration batches in place, so the next layer calibrates on
the outputs of the quantized one; :func:`forward_context` is the autocast
every such pass runs in.  calibration/quantize.py (the model in memory) and
calibration/layerwise.py (``--stream``) both use it.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from qgemv import arch


class StopForward(Exception):
    """Raised by a hook to end a forward pass early (caught by the walker's callers)."""


def decoder_layers(model: nn.Module):
    """(path, the ModuleList of decoder layers) of a causal LM; ValueError for an architecture without one."""
    for path in (arch.LAYERS, "transformer.h", "model.decoder.layers"):
        try:
            return path, model.get_submodule(path)
        except AttributeError:
            continue
    raise ValueError(f"{type(model).__name__}: no decoder layers found (Llama-style model.layers expected)")


def catch_layer0_inputs(forward, layer0, samples, batch_size, device):
    """(hidden states entering decoder layer 0, one per batch, and its keyword arguments), on ``device``.

    forward(ids) runs the model on one batch of samples (int64 [b, L], on the
    CPU) far enough to reach layer 0, whose pre-hook then stops it.
    """
    cache = {"hidden": [], "kwargs": None}

    def catch(_mod, args, kwargs):
        cache["hidden"].append(args[0] if args else kwargs.pop("hidden_states"))
        if cache["kwargs"] is None:
            cache["kwargs"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        raise StopForward

    handle = layer0.register_forward_pre_hook(catch, with_kwargs=True)
    try:
        for b in range(0, samples.shape[0], batch_size):
            try:
                forward(samples[b : b + batch_size])
            except StopForward:
                pass
    finally:
        handle.remove()

    def to_dev(v):
        if torch.is_tensor(v):
            return v.to(device)
        if isinstance(v, tuple) and all(torch.is_tensor(t) for t in v):
            return tuple(t.to(device) for t in v)
        return v

    return [h.to(device) for h in cache["hidden"]], {k: to_dev(v) for k, v in cache["kwargs"].items()}


def forward_context(forward_dtype: Optional[torch.dtype], device):
    """A factory of the context every calibration forward pass runs in: autocast to ``forward_dtype``
    (bfloat16 / float16), or nothing for None / float32."""
    dev_type = torch.device(device).type

    def fwd():
        if forward_dtype is None or forward_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=dev_type, dtype=forward_dtype)

    return fwd


def advance(layer: nn.Module, xs: list, kwargs: dict, fwd) -> None:
    """xs[i] <- layer(xs[i]) for each [b, L, hidden] batch, in place and in xs[i]'s dtype (autocast can
    leave a layer's output in the lower dtype; the residual stream between layers keeps the model's)."""
    with fwd():
        for i, h in enumerate(xs):
            o = layer(h, **kwargs)
            xs[i] = (o[0] if isinstance(o, tuple) else o).to(h.dtype)


def layer_runner(kwargs: dict, fwd):
    """run(layer, xs) -> the layer's outputs for each [b, L, hidden] tensor of xs (a new list; see advance)."""

    def run(layer, xs):
        ys = list(xs)
        advance(layer, ys, kwargs, fwd)
        return ys

    return run


__all__ = ["StopForward", "advance", "catch_layer0_inputs", "decoder_layers", "forward_context", "layer_runner"]
