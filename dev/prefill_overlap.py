"""Prefill by dequantize + cuBLAS with the rows in slices on two streams, so that one slice's
dequantization runs beside the previous slice's GEMM: can the dense path reach fp16 cuBLAS for
M >= 512 (issue 24, part 3)?  An experiment, not in the product until it measures a gain.

    python dev/prefill_overlap.py [--ms 512,1024,2048,4096] [--slices 4,8] [--out runs/prefill_overlap]

Per (shape, format, M): fp16 cuBLAS, the path the library ships (wgmma up to 512 tokens, dequantize
+ cuBLAS above), and the sliced version: slice i of the weight's 16-row panels runs
`qgemv` forced onto the dequantize + cuBLAS path on stream i % 2, then the slices' outputs are
concatenated (the cat is timed alone too: a version inside the library would write each slice
into its columns of y).  Every sliced result is checked against the shipped one.

Prediction (before any run): the GEMM is compute-bound and the dequantization bandwidth-bound, so
they should overlap almost fully; the sliced time should approach fp16's plus one slice's
dequantization.  28672x8192 int4 at M = 1024: dense 851 us, fp16 647 (BENCHMARKS.md, 2026-12-01),
dequantization about 200 us, so with 8 slices about 647 + 25 + the cat (about 30 us), 1.09x fp16
instead of 1.31x; at M = 4096 within 3% of fp16.

Measured (2026-12-02, H200, --ms 1024,4096 --slices 8): no gain.  The large shapes are level
with the shipped path (57344x8192 int4 M = 1024: 1.31x fp16 against 1.30x), the small ones 1.3-7x
slower (eight launches per call): cuBLAS's GEMM fills every SM, so the second stream's
dequantization runs only in its tails.  Kept as the record of that experiment (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import qgemv
from qgemv import formats
from qgemv.eval.bench_gemv import Timer

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (57344, 8192), (8192, 28672)]
FORMATS = {"int8": formats.QuantConfig(8), "int4": formats.QuantConfig(4),
           "int4g128a": formats.QuantConfig(4, 128, False)}


def sliced(lin: qgemv.QuantLinear, slices: int, streams, testing):
    """fn(x): lin(x) by `slices` row slices on alternating streams, forced onto dequantize + cuBLAS."""
    n, cfg = lin.out_features, lin.config
    rows = ((n + slices - 1) // slices + 15) // 16 * 16  # whole 16-row panels per slice
    bounds = [(r, min(r + rows, n)) for r in range(0, n, rows)]
    parts = []
    for r0, r1 in bounds:
        z = None if lin.zeros is None else lin.zeros[r0:r1]
        parts.append((lin.qweight[r0:r1], lin.scales[r0:r1], z))
    k = lin.in_features

    def one(x, qw, s, z):
        return qgemv.ops.linear(x, qgemv.PackedWeight(qw, s, z, cfg, k), checked=True)

    def fn(x, cat=True):
        main = torch.cuda.current_stream()
        for st in streams:
            st.wait_stream(main)  # x is written on the main stream
        ys = []
        testing.set_prefill_path(testing.PREFILL_DENSE)
        try:
            for i, (qw, s, z) in enumerate(parts):
                st = streams[i % len(streams)]
                with torch.cuda.stream(st):
                    y = one(x, qw, s, z)
                y.record_stream(main)
                ys.append(y)
        finally:
            testing.set_prefill_path(-1)
        for st in streams:
            main.wait_stream(st)
        return torch.cat(ys, dim=-1) if cat else ys

    return fn


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", default="512,1024,2048,4096")
    ap.add_argument("--slices", default="4,8")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--out", default="runs/prefill_overlap")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or qgemv._ext.MODULE is None:
        print(f"needs a GPU and the compiled extension ({qgemv._ext.REASON})", file=sys.stderr)
        return 2
    testing = qgemv._ext.MODULE.testing
    timer = Timer()
    streams = [torch.cuda.current_stream(), torch.cuda.Stream()]
    ms = [int(v) for v in args.ms.split(",")]
    slice_counts = [int(v) for v in args.slices.split(",")]
    rows = []
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
        for name in args.formats.split(","):
            cfg = FORMATS[name]
            qw, s, z = formats.quantize(w, cfg)
            lin = qgemv.QuantLinear.from_quantized(torch.nn.Linear(k, n, bias=False, device="meta"), cfg, qw, s, z)
            fns = {c: sliced(lin, c, streams, testing) for c in slice_counts}
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                want = lin(x).float()
                row = dict(N=n, K=k, format=name, M=m,
                           fp16_us=timer(lambda: torch.matmul(x, w.t()), iters=20),
                           shipped_us=timer(lambda: lin(x), iters=20))
                for c, fn in fns.items():
                    got = fn(x).float()
                    rel = ((got - want).norm() / want.norm()).item()
                    assert rel < 1e-2, f"{n}x{k} {name} M={m} slices={c}: rel error {rel:.2e}"
                    row[f"sliced{c}_us"] = timer(lambda: fn(x), iters=20)
                    ys = fn(x, cat=False)
                    row[f"cat{c}_us"] = timer(lambda: torch.cat(ys, dim=-1), iters=20)
                rows.append(row)
                best = min(row[f"sliced{c}_us"] - row[f"cat{c}_us"] for c in slice_counts)
                print(f"{n}x{k} {name:9s} M={m:5d}: fp16 {row['fp16_us']:8.1f}  shipped {row['shipped_us']:8.1f} "
                      f"({row['shipped_us'] / row['fp16_us']:.2f}x)  "
                      + "  ".join(f"sliced{c} {row[f'sliced{c}_us']:8.1f} (cat {row[f'cat{c}_us']:.1f})"
                                  for c in slice_counts)
                      + f"  best without the cat {best / row['fp16_us']:.2f}x", flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "command": " ".join(["python dev/prefill_overlap.py"] + list(sys.argv[1:] if argv is None else argv)),
                   "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
