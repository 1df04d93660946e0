"""The per-op GEMV at 16 tokens against 1, on a model's decode shapes, in CUDA graphs over rotated weight copies.

    python dev/m16_probe.py [--model llama2-7b] [--variants int4g128a,int4,int8] [--ms 1,16] [--tiled]

Batch 16's per-op step spends half its time in the GEMVs at 50% of the read ceiling (dev/PERSISTENT.md, "Batch 16
today").  This prints, for each of the model's linears, µs a call and the share of the read ceiling measured in the
same run (the weight's bytes only), at each M; --tiled adds the tiled GEMM (gemm_mma.cu) forced at 17 tokens
(32-token blocks).  (Its 16-token blocks, reached through a testing knob, ran 1.0-1.8x slower than the GEMV at 16
tokens on the H100, 2026-12-06, and left the product: git show 79d7e7d:dev/m16_probe.py.)
Each call's weight is one of enough copies to pass 4x the L2 (60 MB on the H200), one call on each in a CUDA
graph (decode_attn_probe.timed), best of 5.
"""
import argparse

import torch

import qgemv
from qgemv import formats
from qgemv.eval.bench_gemv import QCFG, Timer, read_ceiling

from decode_attn_probe import timed  # dev/, beside this script

SHAPES = {  # (name, N, K): fused q/k/v, o, fused gate/up, down
    "llama2-7b": [("qkv", 12288, 4096), ("o", 4096, 4096), ("gate_up", 22016, 4096), ("down", 4096, 11008)],
    "llama3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
}


def rotating(fns, x):
    """A call that runs the next of fns on x each time: n = len(fns) calls in one graph touch every copy."""
    state = {"i": 0}

    def call():
        fns[state["i"] % len(fns)](x)
        state["i"] += 1
    return call


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama2-7b", choices=sorted(SHAPES))
    ap.add_argument("--variants", default="int4g128a,int4,int8")
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--tiled", action="store_true", help="add the tiled GEMM's 32-token blocks at 17 tokens")
    a = ap.parse_args(argv)
    from qgemv import _C

    ceil = read_ceiling(Timer())["read_GBps"]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, read ceiling {ceil:.0f} GB/s")
    ms = [int(v) for v in a.ms.split(",")]
    for var in a.variants.split(","):
        cfg = QCFG[var]
        for name, n, k in SHAPES[a.model]:
            qw, s, z = formats.quantize(torch.randn(n, k, device="cuda") * 0.02, cfg)
            nbytes = formats.nbytes(qw, s, z)
            copies = max(2, -(-240 * 2**20 // nbytes))
            fns = []
            for _ in range(copies):
                lin = qgemv.QuantLinear.from_quantized(torch.nn.Linear(k, n, bias=False, device="meta"), cfg,
                                                       qw.clone(), s.clone(), None if z is None else z.clone())
                fns.append(lin)
            cells = []
            # (M, label): the GEMV at each M; with --tiled the tiled GEMM's 32-token blocks at 17 tokens
            runs = [(m, f"M={m}") for m in ms] + ([(17, "tiled17")] if a.tiled else [])
            for m, tag in runs:
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                _C.testing.set_prefill_path(_C.testing.PREFILL_TILED if m > 16 else -1)
                try:
                    us = timed(rotating(fns, x), n=len(fns))
                finally:
                    _C.testing.set_prefill_path(-1)
                cells.append(f"{tag} {us:7.1f} us ({100 * nbytes / us / 1e3 / ceil:4.1f}%)")
            print(f"{a.model} {var:10s} {name:8s} {n:6d}x{k:<6d} " + "  ".join(cells), flush=True)
            del fns, qw, s, z
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
