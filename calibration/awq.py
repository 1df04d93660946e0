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

from qgemv import arch, formats
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
    def pair(name):
        return name, layer.get_submodule(name)

    groups = [(*pair(norm), [pair(r) for r in readers]) for norm, readers in arch.NORM_READERS]
    groups.append((*pair(f"{arch.MLP}.{arch.UP}"), [pair(f"{arch.MLP}.{arch.DOWN}")]))
    v, o = pair(f"{arch.ATTN}.{arch.V}"), pair(f"{arch.ATTN}.{arch.O}")
    if v[1].out_features == o[1].in_features:
        groups.append((*v, [o]))
    return groups


def scale_layer(layer: nn.Module, targets: dict, hidden: list, run, keep_col_weights: bool) -> tuple:
    """AWQ on one decoder layer: search and fold the scales of every group whose members are all targets.

    targets: {linear name in the layer: (module, QuantConfig)}; run(layer, hidden)
    runs the float layer.  Activations are sampled (4096 rows in all, seeded
    per batch) from each target's input.  Returns (info per scaled group, and
    with keep_col_weights the clipping weights E[(x/s)_k^2] per linear).
    """
    acts = {}
    rows_per_batch = max(1, 4096 // max(len(hidden), 1))

    def keep(inp, n):
        x = inp[0].reshape(-1, inp[0].shape[-1])
        idx = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(len(acts.get(n, []))))
        acts.setdefault(n, []).append(x[idx[:rows_per_batch].to(x.device)].float())

    hooks = [m.register_forward_hook(lambda mod, inp, out, n=n: keep(inp, n)) for n, (m, _) in targets.items()]
    try:
        run(layer, hidden)
    finally:
        for h in hooks:
            h.remove()
    # The clipping search is weighted by E[x_k^2] per input column, divided by
    # s^2 where AWQ scales the input: an unweighted search minimises raw weight
    # error, and after scaling the largest columns are the important ones, so it
    # clipped exactly those (measured: per-channel int4 +357% ppl with it).
    col_w = {n: torch.cat(a).pow(2).mean(0) for n, a in acts.items()} if keep_col_weights else {}
    info = {}
    for prev_name, prev, lins in llama_scale_groups(layer):
        members = [(n, m) for n, m in lins if n in targets]
        if len(members) != len(lins):
            continue  # a skipped member: leave this group unscaled
        x = torch.cat(acts[members[0][0]])
        s, alpha, ratio = search_scales(x, [m for _, m in members], [targets[n][1] for n, _ in members])
        apply_scales(prev, [m for _, m in members], s)
        for n, _ in members:
            if n in col_w:
                col_w[n] = col_w[n] / s.to(col_w[n].device).pow(2)
        info[prev_name] = {"alpha": alpha, "err_ratio": ratio}
    return info, col_w


class AWQ:
    """AWQ scales folded in, then round-to-nearest with an output-weighted clipping search.

    The method protocol is described in :class:`calibration.gptq.GPTQ`.
    """

    new_stats = None

    def __init__(self, clip_grid: int = 20):
        self.clip_grid = clip_grid
        self.info = {}

    def before(self, layer, targets, hidden, run) -> dict:
        self.info, col_w = scale_layer(layer, targets, hidden, run, keep_col_weights=True)
        return col_w

    def quantize(self, name: str, weight: torch.Tensor, cfg: QuantConfig, stat: torch.Tensor):
        sc, zc = formats.choose_params(weight, cfg, name, self.clip_grid, col_weight=stat)
        return formats.quantize_with_params(weight, sc, zc, cfg), sc, zc, {}


class AWQThenGPTQ:
    """AWQ scales folded in first, then GPTQ on the scaled weights (Hessians of the scaled inputs)."""

    def __init__(self, gptq):
        self.gptq = gptq
        self.new_stats = gptq.new_stats
        self.info = {}

    def before(self, layer, targets, hidden, run) -> dict:
        self.info, _ = scale_layer(layer, targets, hidden, run, keep_col_weights=False)
        return {}

    def quantize(self, name, weight, cfg, stat):
        return self.gptq.quantize(name, weight, cfg, stat)

    def quantize_many(self, names, weights, cfg, stat):
        return self.gptq.quantize_many(names, weights, cfg, stat)
