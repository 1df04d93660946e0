"""Run one qgemv GEMV / GEMM configuration a few times, for ncu / compute-sanitizer.

    python dev/profile_one.py --variant int4 --n 28672 --k 8192 --m 1
"""

import argparse

import torch

from qgemv.eval.bench_gemv import QCFG  # noqa: E402

import qgemv  # noqa: E402
from qgemv import formats as F  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="int4", choices=sorted(QCFG))
    ap.add_argument("--n", type=int, default=28672)
    ap.add_argument("--k", type=int, default=8192)
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--path", type=int, default=-1, help="force the M > 16 path (qgemv._C.testing.set_prefill_path)")
    ap.add_argument("--wgmma-shape", type=int, default=-1, help="force the wgmma block shape")
    a = ap.parse_args()
    cfg = QCFG[a.variant]
    qw, s, z = F.quantize(torch.randn(a.n, a.k, device="cuda") * 0.02, cfg)
    lin = qgemv.QuantLinear.from_quantized(torch.nn.Linear(a.k, a.n, bias=False, device="meta"), cfg, qw, s, z)
    x = torch.randn(a.m, a.k, device="cuda", dtype=torch.float16 if a.dtype == "fp16" else torch.bfloat16)
    if a.path >= 0 or a.wgmma_shape >= 0:
        from qgemv import _C

        _C.testing.set_prefill_path(a.path)
        _C.testing.set_wgmma_shape(a.wgmma_shape)
    for _ in range(a.iters):
        lin(x)
    torch.cuda.synchronize()
    print("ok", tuple(lin(x).shape))


if __name__ == "__main__":
    main()
