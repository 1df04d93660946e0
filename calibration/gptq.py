"""GPTQ for one linear layer, into qgemv's packed formats.

The algorithm (Frantar et al., 2022): quantize W column by column; after each
column, spread its rounding error over the columns not yet quantized, weighted
by the inverse Hessian H^-1 of the layer's inputs (H = 2 X^T X / n).  Columns
are processed in blocks of 128 with a lazy batch update.

Choices made here:
* Dampening: lambda * mean(diag(H)) is added to the diagonal.  If Cholesky
  still fails the damping is raised tenfold, up to three times, then a
  ValueError names the layer.
* Group-wise: without act-order, each group's scale (and zero) is chosen when
  the algorithm reaches the group, from the error-updated weights (the usual
  GPTQ behaviour).  With act-order, groups are "static": their parameters come
  from the original weights in the original column order, so the permutation
  can be undone on the codes and inference needs no g_idx gather.
* Dead inputs (diag(H) = 0) get weight 0 and a unit diagonal.
"""

from __future__ import annotations

import functools
import math

import torch

from qgemv import formats
from qgemv.formats import QuantConfig


class Hessian:
    """Running H = 2/n * sum x x^T over the rows of the inputs seen so far (fp32).

    ``tf32``: on CUDA, the x^T x products use TF32 tensor cores (10-bit
    mantissa inputs, fp32 sums); the calibration drivers turn it on when the
    forward passes themselves run in bfloat16 / float16, whose activations
    carry no more precision than that.
    """

    def __init__(self, k: int, device="cpu", tf32: bool = False):
        self.H = torch.zeros(k, k, dtype=torch.float32, device=device)
        self.n = 0
        self.tf32 = tf32 and self.H.is_cuda

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(self.H.device, torch.float32)
        m = x.shape[0]
        if m == 0:
            return
        self.H.mul_(self.n / (self.n + m))
        self.n += m
        x = x * math.sqrt(2.0 / self.n)
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = prev or self.tf32
        try:
            self.H.addmm_(x.t(), x)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev


def _inverse_cholesky(H: torch.Tensor, damp: float, name: str):
    mean_diag = torch.mean(torch.diag(H)).item()
    for attempt in range(4):
        lam = damp * (10**attempt) * mean_diag
        Hd = H.clone()
        Hd.diagonal().add_(lam)
        L, info = torch.linalg.cholesky_ex(Hd)
        if info.item() == 0:
            Hinv = torch.cholesky_inverse(L)
            U, info2 = torch.linalg.cholesky_ex(Hinv, upper=True)
            if info2.item() == 0:
                return U, damp * (10**attempt)
    raise ValueError(
        f"{name}: the Hessian is not positive definite even with damping {damp * 1000:g} x mean(diag(H)); "
        "use more calibration samples or a larger --damp"
    )


def gptq_quantize(
    W: torch.Tensor,
    H: torch.Tensor,
    cfg: QuantConfig,
    damp: float = 0.01,
    block: int = 128,
    act_order: bool = False,
    name: str = "weight",
    clip_grid: int = 20,
    split=None,
):
    """GPTQ-quantize W [N, K] given its input Hessian H [K, K].

    split: row counts that partition N (linears sharing the input, stacked):
    then a list of one result per part is returned, each exactly what that
    part alone would give (every step is row-wise, given H) up to the
    summation order of the block updates' matrix products.

    clip_grid: the clipping search of qgemv.formats.choose_params for every
    row / group's scale (0 = plain min/max range), judged by the error each
    column causes in the output (weighted by diag(H)).

    Returns (qweight, scales, zeros or None, info) in the format of
    qgemv.formats.quantize(W, cfg); info has the damping used and the
    Hessian-weighted error sum.
    """
    formats.check_weight(W, name, cfg.group_size)
    n, k = W.shape
    if split is not None and sum(split) != n:
        raise ValueError(f"{name}: split {list(split)} does not add up to {n} rows")
    W = W.detach().to(H.device, torch.float32).clone()
    H = H.clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(k, device=W.device)
    # Clipping is judged by the output error each column causes, E[x_k^2] =
    # diag(H) / 2, not by the raw weight error.
    params = _ColumnParams(W, cfg, name, clip_grid, torch.diag(H), perm, act_order)
    W = W[:, perm]
    H = H[perm][:, perm]
    U, used_damp = _inverse_cholesky(H, damp, name)
    Q, loss = _gptq_sweep(W, U, params, block)
    Q = Q[:, torch.argsort(perm)]
    scales, zeros = params.scales, params.zeros
    if split is None:
        qweight = formats.quantize_with_params(Q, scales, zeros, cfg)
        return qweight, scales, zeros, {"damp": used_damp, "loss": float(loss.sum())}
    out, a = [], 0
    for rows in split:
        b = a + rows
        zp = zeros[a:b].contiguous() if zeros is not None else None
        out.append((formats.quantize_with_params(Q[a:b], scales[a:b], zp, cfg), scales[a:b].contiguous(), zp,
                    {"damp": used_damp, "loss": float(loss[a:b].sum())}))
        a = b
    return out


class _ColumnParams:
    """The scales and zero points of a GPTQ run, and each permuted column's view of them.

    Per-channel parameters, and groups under act-order, are chosen up front
    from W [N, K] (original column order); otherwise each group's are chosen
    when the sweep reaches its first column, from the error-updated weights
    (``refresh``).  ``column(j)`` gives permuted column j's scale ([N] fp32)
    and its lowest and highest code minus the zero point ([N] fp32 or
    floats): the codes clamp(round(w / s) + z, qmin, qmax) - z equal
    clamp(round(w / s), qmin - z, qmax - z), small integers in fp32.  The
    permutation is looked up on the host (one device sync in all, none per
    column).
    """

    def __init__(self, W, cfg: QuantConfig, name: str, clip_grid: int, hdiag, perm, act_order: bool):
        n, k = W.shape
        G = cfg.group_size
        self.cfg, self.name, self.clip_grid, self.G = cfg, name, clip_grid, G
        self.qmin, self.qmax = formats.code_range(cfg)
        self.hdiag, self.perm = hdiag, perm
        self.scales = torch.empty((n,) if G is None else (n, k // G), dtype=torch.float16, device=W.device)
        self.zeros = None if (cfg.bits == 8 or cfg.symmetric) else torch.empty(n, k // G, dtype=torch.uint8,
                                                                                 device=W.device)
        self.static = G is None or act_order
        if self.static:
            s, z = formats.choose_params(W, cfg, name, clip_grid, hdiag)
            self.scales.copy_(s)
            if self.zeros is not None:
                self.zeros.copy_(z)
        self.perm_host = perm.tolist()
        self.scales_f = self.scales.float()
        self.z_const = 0.0 if cfg.bits == 8 else 8.0
        self.lo_f = self.qmin - self.zeros.float() if self.zeros is not None else None
        self.hi_f = self.qmax - self.zeros.float() if self.zeros is not None else None

    def refresh(self, j: int, W1, i: int) -> None:
        """Before permuted column j (column i of the block W1): a dynamic group starting there gets its
        parameters from the error-updated weights (blocks are 128 wide and start at multiples of G, so the
        group lies in W1)."""
        G = self.G
        if self.static or j % G:
            return
        s, z = formats.choose_params(W1[:, i : i + G], self.cfg, self.name, self.clip_grid,
                                     self.hdiag[self.perm[j : j + G]])
        n, g = W1.shape[0], j // G
        self.scales[:, g] = s.reshape(n)
        self.scales_f[:, g] = self.scales[:, g].float()
        if self.zeros is not None:
            self.zeros[:, g] = z.reshape(n)
            self.lo_f[:, g] = self.qmin - self.zeros[:, g].float()
            self.hi_f[:, g] = self.qmax - self.zeros[:, g].float()

    def column(self, j: int):
        lo, hi = self.qmin - self.z_const, self.qmax - self.z_const
        if self.G is None:
            return self.scales_f, lo, hi
        g = self.perm_host[j] // self.G
        if self.lo_f is None:
            return self.scales_f[:, g], lo, hi
        return self.scales_f[:, g], self.lo_f[:, g], self.hi_f[:, g]


def _gptq_sweep(W, U, params: _ColumnParams, block: int):
    """The GPTQ column sweep over W [N, K] (permuted, fp32, updated in place) with U the upper Cholesky
    factor of the permuted, damped inverse Hessian: returns the dequantized weights Q [N, K] (permuted) and
    each row's Hessian-weighted error [N]."""
    n, k = W.shape
    Q = torch.zeros_like(W)
    loss = torch.zeros(n, device=W.device)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        E1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            j = i1 + i
            params.refresh(j, W1, i)
            s, lo, hi = params.column(j)
            w = W1[:, i]
            d = U1[i, i]
            # seven kernels per column: the dequantized value and the error are written in place
            dq = torch.mul(torch.round(w / s).clamp_(lo, hi), s, out=Q1[:, i])
            err = torch.div(w - dq, d, out=E1[:, i])
            W1[:, i:].addr_(err, U1[i, i:], alpha=-1)  # one kernel: W1 -= err (x) U1[i, i:]
        loss += E1.square().sum(1) / 2  # (w - dq)^2 / d^2 / 2, summed over the block
        Q[:, i1:i2] = Q1
        W[:, i2:] -= E1 @ U[i1:i2, i2:]
    return Q, loss


class GPTQ:
    """The GPTQ method for calibration.quantize: input Hessians, then :func:`gptq_quantize`.

    Protocol (shared by every method of calibration/): ``new_stats(k, device)``
    makes the per-input statistic that the driver feeds each calibration
    batch's input with ``.add(x)`` (None: the method collects nothing);
    ``before(layer, targets, hidden, run)`` may change the float layer first
    and returns precomputed statistics per linear; ``quantize(name, weight,
    cfg, stat)`` returns (qweight, scales, zeros or None, info).
    """

    def __init__(self, damp: float = 0.01, act_order: bool = False, clip_grid: int = 20, tf32_hessian: bool = False):
        self.damp, self.act_order, self.clip_grid = damp, act_order, clip_grid
        self.new_stats = functools.partial(Hessian, tf32=tf32_hessian)

    def before(self, layer, targets, hidden, run) -> dict:
        return {}

    def quantize(self, name: str, weight: torch.Tensor, cfg: QuantConfig, stat: Hessian):
        return gptq_quantize(weight, stat.H, cfg, damp=self.damp, act_order=self.act_order, name=name,
                             clip_grid=self.clip_grid)

    def quantize_many(self, names: list, weights: list, cfg: QuantConfig, stat: Hessian) -> list:
        """quantize() for linears of one format that share ``stat`` (q/k/v; gate/up), solved as one stacked
        weight: one column sweep instead of one per linear."""
        if len(weights) == 1:
            return [self.quantize(names[0], weights[0], cfg, stat)]
        w = torch.cat([x.detach().to(stat.H.device, torch.float32) for x in weights])
        return gptq_quantize(w, stat.H, cfg, damp=self.damp, act_order=self.act_order, name="+".join(names),
                             clip_grid=self.clip_grid, split=[x.shape[0] for x in weights])
