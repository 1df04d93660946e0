"""A reduced sweep of every GEMV kernel instance, for compute-sanitizer.

    compute-sanitizer --tool memcheck  --error-exitcode 9 python dev/sanitize_sweep.py
    compute-sanitizer --tool racecheck --error-exitcode 9 python dev/sanitize_sweep.py

Covers int8, int4 per-channel, group-wise symmetric and with zero points
(g32/g64/g128), fp16 and bf16, M in {1, 5, 16, 24, 40, 72, 200}: both GEMV
n-tile counts; the tiled GEMM with 32-token blocks (24; 72 = three of them)
and 64-token blocks (40); the dequantize + cuBLAS path (200). K with and
without an edge tile, N not a multiple of 16 (a partial panel), small N with
long rows (the tiled GEMM splits K: 40 x 4096 four ways, 17 x 17408 eight),
N = 8197 (the two-row-tile instance for 9..16 tokens), N = 20005 (1251
blocks of 16 rows: the persistent grid for 1..8 tokens on an H200), and the
three SGEMV kernels; every result is compared with the reference too.  Up to
8 tokens each case runs again with an act-order perm (the GEMV's own gather
in shared memory where csrc/qgemv.h's gemv_gathers allows it).

    --ms 1,5,16,24,40,72   only the token counts that stay on qgemv's own
                           kernels (M = 200 also runs cuBLAS, whose kernels
                           racecheck flags)
    --small                three formats (int8, int4, int4 g128 with zeros),
                           fp16, three shapes (33 x 136, 40 x 4096, 130 x
                           2880): racecheck of the tiled GEMM in seconds,
                           where the full sweep at M > 16 takes over 10 min
    --wgmma                for M > 16, also the wgmma GEMM (csrc/gemm_wgmma.cu)
                           with each block shape forced
    --gemv-pdl MODE        launch the GEMVs with qgemv.set_gemv_pdl(MODE)
                           (programmatic dependent launch, sm_90; default:
                           the library's, which is off)
"""

import itertools
import sys

import torch


import qgemv  # noqa: E402
from qgemv import formats as F  # noqa: E402


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,5,16,24,40,72,200", help="token counts, comma separated")
    ap.add_argument("--small", action="store_true", help="3 formats, fp16, 3 shapes (see the docstring)")
    ap.add_argument("--wgmma", action="store_true",
                    help="for M > 16 also run the wgmma GEMM with each block shape forced (cc 9.0)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each case as it starts (for time-boxed runs)")
    ap.add_argument("--gemv-pdl", type=int, default=-1,
                    help="qgemv.set_gemv_pdl mode for the GEMV launches (-1: the library's default)")
    args = ap.parse_args(argv)
    ms = [int(v) for v in args.ms.split(",")]
    qgemv.set_gemv_pdl(args.gemv_pdl)
    from qgemv import _C

    if args.wgmma and not _C.wgmma_available():
        print("--wgmma: this GPU or build has no wgmma GEMM")
        return 2
    torch.manual_seed(0)
    # every (group size, zero points) kernel instance
    cfgs = [F.QuantConfig(8), F.QuantConfig(4)] + [
        F.QuantConfig(4, g, sym) for g in (32, 64, 128) for sym in (True, False)]
    # odd N and K, a partial panel, a long row, two row tiles per warp, a persistent grid
    shapes = [(33, 136), (7, 2880), (40, 4096), (17, 17408), (8197, 136), (20005, 256)]
    dtypes = (torch.float16, torch.bfloat16)
    if args.small:
        cfgs = [F.QuantConfig(8), F.QuantConfig(4), F.QuantConfig(4, 128, False)]
        shapes = [(33, 136), (40, 4096), (130, 2880)]
        dtypes = (torch.float16,)
    bad = 0
    n_runs = 0
    for cfg, (n, k), dt, m in itertools.product(cfgs, shapes, dtypes, ms):
        if cfg.group_size and k % cfg.group_size:
            continue
        qw, s, z = F.quantize(torch.randn(n, k, device="cuda") * 0.02, cfg)
        x = torch.randn(m, k, device="cuda", dtype=dt)
        if args.verbose:
            print(f"case {n_runs}: {cfg.name} {n}x{k} M={m} {dt}", flush=True)
        lin = qgemv.QuantLinear.from_quantized(torch.nn.Linear(k, n, bias=False, device="meta"), cfg, qw, s, z)
        ref = x.double() @ F.dequantize(qw, s, z, cfg, k).double().t()
        forced = [(-1, -1)]  # (prefill path, wgmma shape): the dispatch's own choice
        if args.wgmma and m > 16:
            forced += [(_C.testing.PREFILL_WGMMA, shape) for shape in range(_C.testing.wgmma_shape_count())]
        for path, shape in forced:
            _C.testing.set_prefill_path(path)
            _C.testing.set_wgmma_shape(shape)
            y = lin(x).double()
            rel = ((y - ref).norm() / ref.norm()).item()
            n_runs += 1
            if not rel < 1e-2:
                bad += 1
                print(f"MISMATCH {cfg.name} {n}x{k} M={m} {dt} path {path} shape {shape}: rel {rel:.2e}")
        _C.testing.set_prefill_path(-1)
        _C.testing.set_wgmma_shape(-1)
        if m <= 8:  # act-order: a permuted input, gathered inside the GEMV where gemv_gathers holds
            lin.perm = torch.randperm(k, device="cuda")
            y = lin(x).double()
            ref_p = x[:, lin.perm].double() @ F.dequantize(qw, s, z, cfg, k).double().t()
            rel = ((y - ref_p).norm() / ref_p.norm()).item()
            n_runs += 1
            if not rel < 1e-2:
                bad += 1
                print(f"MISMATCH {cfg.name} {n}x{k} M={m} {dt} with perm: rel {rel:.2e}")
            lin.perm = None
    for kern, (n, k) in itertools.product(["k32", "k128", "k16"], [(9, 12), (33, 136), (5, 1000)]):
        if kern == "k16" and k > 16:
            continue
        A, x = torch.randn(n, k, device="cuda"), torch.randn(k, device="cuda")
        y = qgemv.sgemv(A, x, kernel=kern)
        n_runs += 1
        if not torch.allclose(y, A @ x, rtol=1e-4, atol=1e-4):
            bad += 1
            print(f"MISMATCH sgemv {kern} {n}x{k}")
    torch.cuda.synchronize()
    print(f"sanitize_sweep: {n_runs} launches checked, {bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
