"""Seeded random-shape fuzz: the CUDA ops against the fp64 reference (issue 20).

Each case draws a format, an activation dtype, N and K (multiples of 8 up to
16384, log-uniform, so most cases are small and a few large), M in 0..300
(which crosses every dispatch path: GEMV, tiled GEMM, wgmma GEMM, dequantize
+ cuBLAS), and a layout: x contiguous, transposed, sliced with an unaligned
storage offset, or 3-D; the packed weight and scales either plain or views
into a larger buffer at an aligned offset.  A view of qweight at an offset
that is not 16-byte aligned must be refused with the alignment message and
leave the CUDA context usable.

    QGEMV_FUZZ_CASES=2000 python -m pytest -q tests/test_fuzz_cuda.py   # the H200 run in BENCHMARKS.md

The default (200 cases) keeps a plain GPU test run short.  Tolerances are
test_cuda.py's (_check); fp32 activations take the dequantize + cuBLAS path
and get a K * 2^-24 relative bound.
"""

import math
import os
import random

import pytest
import torch

import qgemv
from qgemv import formats

from conftest import requires_cuda
from test_cuda import CFGS, _check

CASES = int(os.environ.get("QGEMV_FUZZ_CASES", "200"))
SEED = int(os.environ.get("QGEMV_FUZZ_SEED", "20"))


def _dim(rng, lo=8, hi=16384):
    return max(lo, min(hi, 8 * round(math.exp(rng.uniform(math.log(lo), math.log(hi))) / 8)))


def _view_at(t: torch.Tensor, offset_elems: int) -> torch.Tensor:
    """A contiguous copy of t living ``offset_elems`` elements into a larger buffer."""
    buf = torch.empty(t.numel() + offset_elems, dtype=t.dtype, device=t.device)
    v = buf[offset_elems:].view(t.shape)
    v.copy_(t)
    return v


def _call(cfg, x, qw, s, z, k):
    return qgemv.ops.linear(x, qgemv.PackedWeight(qw, s, z, cfg, k))


def _case(rng: random.Random):
    name = rng.choice(sorted(CFGS))
    cfg = CFGS[name]
    k = _dim(rng)
    if cfg.group_size:
        k = max(cfg.group_size, k // cfg.group_size * cfg.group_size)
    n = _dim(rng)
    m = rng.choice([0, 1, 2, 3, 5, 8, 9, 16]) if rng.random() < 0.6 else rng.randint(0, 300)
    dtype = rng.choice([torch.float16, torch.bfloat16, torch.float32])
    x_layout = rng.choice(["contiguous", "transposed", "offset", "3d"])
    w_layout = rng.choice(["plain", "aligned_offset", "misaligned_offset"])
    return name, cfg, n, k, m, dtype, x_layout, w_layout


def _x(m, k, dtype, layout):
    if layout == "transposed":
        return torch.randn(k, m, device="cuda", dtype=dtype).t()
    if layout == "offset":  # rows start 2 elements in: not 16-byte aligned, the op must copy
        return torch.randn(m, k + 2, device="cuda", dtype=dtype)[:, 2:]
    if layout == "3d" and m % 2 == 0 and m:
        return torch.randn(2, m // 2, k, device="cuda", dtype=dtype)
    return torch.randn(m, k, device="cuda", dtype=dtype)


@requires_cuda
@pytest.mark.parametrize("block", range(max(1, CASES // 50)))
def test_fuzz_cuda_ops_against_the_reference(block):
    rng = random.Random(SEED * 100003 + block)
    for _ in range(min(50, CASES)):
        name, cfg, n, k, m, dtype, x_layout, w_layout = case = _case(rng)
        w = torch.randn(n, k, device="cuda") * 0.02
        qw, s, z = formats.quantize(w, cfg)
        if w_layout != "plain":
            align = 16 // qw.element_size()
            qw = _view_at(qw, align * rng.randint(1, 3) + (rng.randint(1, align - 1) if w_layout ==
                                                             "misaligned_offset" else 0))
            s = _view_at(s, rng.randint(1, 9))
        x = _x(m, k, dtype, x_layout)
        if w_layout == "misaligned_offset":
            with pytest.raises((RuntimeError, ValueError), match="qweight must start on a 16-byte boundary"):
                _call(cfg, x, qw, s, z, k)
            assert torch.ones(2, device="cuda").sum().item() == 2, case
            continue
        if m == 0:
            y = _call(cfg, x, qw, s, z, k)
            assert y.shape == (*x.shape[:-1], n) and y.dtype == dtype, case
            continue
        if dtype == torch.float32:
            y = _call(cfg, x, qw, s, z, k).double().reshape(-1, n)
            wd = formats.dequantize(qw, s, z, cfg, k).double()
            xd = x.double().reshape(-1, k)
            ref = xd @ wd.t()
            bound = k * 2.0**-24 * (xd.abs() @ wd.abs().t()) + 1e-6
            assert not torch.isnan(y).any() and ((y - ref).abs() <= bound).all(), case
            continue
        try:
            _check(cfg, x, qw, s, z, k)
        except AssertionError as e:
            raise AssertionError(f"{case}: {e}") from None
