"""AWQ-style activation-aware scaling (Lin et al., 2023), folded into the model.

For linears that share one input x (q/k/v after input_layernorm, gate/up after
post_attention_layernorm, down after up_proj), multiply weight input-channel c
by s_c and divide x's channel c by s_c: the float model is unchanged, but
channels with large activations get finer quantization steps.  The scales are

    s = mean|x|^alpha, normalised so that sqrt(max(s) * min(s)) = 1,

with alpha picked from a grid on [0, 1] to minimise || x W^T - (x/s) Q(W s)^T ||
over calibration activations.  1/s is folded into the preceding RMSNorm weight
or the preceding linear's output rows, so inference needs no extra op.
"""

from __future__ import annotations

import torch
from torch import nn

from qgemv import formats
from qgemv.formats import QuantConfig


def _qdq(w: torch.Tensor, cfg: QuantConfig) -> torch.Tensor:
    qw, s, z = formats.quantize(w, cfg)
    return formats.dequantize(qw, s, z, cfg, w.shape[1])


@torch.no_grad()
def search_scales(x: torch.Tensor, linears: list, cfgs: list, grid: int = 20) -> tuple:
    """Best per-input-channel scales for ``linears`` (all fed by x [rows, K]).

    Returns (scales fp32 [K], best alpha, error ratio vs alpha = 0).
    """
    x = x.float()
    x_mean = x.abs().mean(0).clamp(min=1e-8)
    ref = [x @ lin.weight.float().t() for lin in linears]
    best, best_err, base_err = None, float("inf"), None
    for i in range(grid + 1):
        alpha = i / grid
        s = x_mean.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        err = 0.0
        for lin, cfg, r in zip(linears, cfgs, ref):
            wq = _qdq(lin.weight.float() * s[None, :], cfg) / s[None, :]
            err += (x @ wq.t() - r).pow(2).mean().item()
        if i == 0:
            base_err = err
        if err < best_err:
            best, best_err, best_alpha = s, err, alpha
    return best, best_alpha, best_err / max(base_err, 1e-30)


@torch.no_grad()
def apply_scales(prev: nn.Module, linears: list, s: torch.Tensor) -> None:
    """Fold: prev's output channel c /= s_c; each linear's input column c *= s_c."""
    s = s.to(linears[0].weight.device)
    if isinstance(prev, nn.Linear):
        prev.weight.div_(s[:, None].to(prev.weight.dtype))
        if prev.bias is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
    elif hasattr(prev, "weight"):  # RMSNorm / LayerNorm
        prev.weight.div_(s.to(prev.weight.dtype))
        if getattr(prev, "bias", None) is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
    else:
        raise TypeError(f"cannot fold AWQ scales into {type(prev).__name__}")
    for lin in linears:
        lin.weight.mul_(s[None, :].to(lin.weight.dtype))


def llama_scale_groups(layer: nn.Module) -> list:
    """(name of prev module, prev module, [(linear name, linear)]) groups of a Llama decoder layer.

    o_proj is scaled through v_proj only when the attention has as many KV
    heads as query heads (otherwise v's channels do not map 1:1 onto o's input).
    """
    attn, mlp = layer.self_attn, layer.mlp
    groups = [
        ("input_layernorm", layer.input_layernorm,
         [("self_attn.q_proj", attn.q_proj), ("self_attn.k_proj", attn.k_proj), ("self_attn.v_proj", attn.v_proj)]),
        ("post_attention_layernorm", layer.post_attention_layernorm,
         [("mlp.gate_proj", mlp.gate_proj), ("mlp.up_proj", mlp.up_proj)]),
        ("mlp.up_proj", mlp.up_proj, [("mlp.down_proj", mlp.down_proj)]),
    ]
    if attn.v_proj.out_features == attn.o_proj.in_features:
        groups.append(("self_attn.v_proj", attn.v_proj, [("self_attn.o_proj", attn.o_proj)]))
    return groups
