"""Imported GPTQ layers against qgemv's native format, and the cost of act-order's input gather (H200 numbers in
BENCHMARKS.md).

    python -m qgemv.eval.bench_import --out runs/bench_import

For each shape (N x K) a GPTQ g128 layer (asymmetric, checkpoint_format
gptq_v2) is packed as GPTQ stores it (qweight [K/8, N], qzeros, scales,
g_idx), read back by :func:`qgemv.importers.decode_gptq` and repacked, once
with the plain g_idx and once with an act-order g_idx (equal groups in
shuffled column order: QuantLinear.perm gathers x).  The native layer holds
the same codes written by qgemv itself.  Each is timed per call under
CUDA-graph replay, 20 calls on rotating weight copies per graph (so no
weight byte comes from the 60 MB L2), median of 20 replays.  The act-order
layer is timed twice: with the GEMV gathering x[..., perm] itself (up to 8
tokens while 4 (M + 1) K bytes fit in 32 KB of shared memory, on at most 512
16-row panels; else gathered first), and with the gather forced to its own kernel first
(qgemv._C.testing.set_gemv_gather); the gather ``x[..., perm]`` is also timed
alone.  Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os

import torch

from qgemv import formats, importers
from qgemv.formats import QuantConfig
from qgemv.nn import QuantLinear

from .bench_gemv import command_line, gemv_gather_off, graph_time

SHAPES = [(4096, 4096), (6144, 4096), (8192, 8192), (14336, 4096), (28672, 4096)]


def gptq_tensors(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, g_idx: torch.Tensor) -> dict:
    """GPTQ's files for codes q [N, K] (0..15, column k in group g_idx[k]), zero points z and scales s [N, ng]."""
    n, k = q.shape
    shifts = torch.arange(8, dtype=torch.int64) * 4
    qweight = (q.t().reshape(k // 8, 8, n).to(torch.int64) << shifts[None, :, None]).sum(1)
    qzeros = (z.t().reshape(z.shape[1], n // 8, 8).to(torch.int64) << shifts).sum(-1)
    as_i32 = lambda t: ((t + 2**31) % 2**32 - 2**31).to(torch.int32)  # noqa: E731 - two's complement words
    return {"l.qweight": as_i32(qweight), "l.qzeros": as_i32(qzeros), "l.scales": s.t().half().contiguous(),
            "l.g_idx": g_idx.to(torch.int32)}


def layers(n: int, k: int, group: int = 128, seed: int = 0) -> dict:
    """{"native", "imported", "imported act-order"}: QuantLinears (CPU) of random int4 g128 asymmetric codes.

    "imported" holds native's function exactly; "imported act-order" the same
    codes with the columns assigned to groups in shuffled order (another
    function, the same bytes and kernel plus the gather)."""
    g = torch.Generator().manual_seed(seed)
    ng = k // group
    q = torch.randint(0, 16, (n, k), generator=g)
    z = torch.randint(0, 16, (n, ng), generator=g)
    s = torch.rand(n, ng, generator=g) * 0.01 + 0.001
    qc = {"bits": 4, "group_size": group, "sym": False, "checkpoint_format": "gptq_v2", "desc_act": True}
    out = {}
    cfg = QuantConfig(4, group, False)
    native = QuantLinear.from_quantized(torch.nn.Linear(k, n, bias=False, device="meta"), cfg,
                                        formats.pack_int4(q.to(torch.uint8)), s.half(), z.to(torch.uint8))
    out["native"] = native
    plain = torch.arange(k) // group
    shuffled = plain[torch.randperm(k, generator=g)]  # act-order: the same groups, columns in another order
    for label, g_idx in (("imported", plain), ("imported act-order", shuffled)):
        d = importers.decode_gptq("l", gptq_tensors(q, z, s, g_idx), set(), qc, k, n)
        out[label], _ = importers.to_quant_linear(d, k, torch.float16)
    return out


def per_call_us(fns, x) -> float:
    def all_calls():
        for f in fns:
            f(x)

    return graph_time(all_calls, replays=20) * 1e3 / len(fns)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/bench_import")
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--copies", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_import needs a CUDA GPU")
    rows = []
    for n, k in SHAPES:
        base = layers(n, k)
        x_check = torch.randn(3, k)
        want = base["native"](x_check)
        assert torch.equal(base["imported"](x_check), want)  # the same codes, repacked exactly
        assert base["imported act-order"].perm is not None
        copies = {label: [copy.deepcopy(m).to("cuda") for _ in range(args.copies)]  # own storage: L2 misses
                  for label, m in base.items()}
        perm = copies["imported act-order"][0].perm
        for mtok in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(mtok, k, device="cuda", dtype=torch.float16)
            t = {label: per_call_us(fns, x) for label, fns in copies.items()}
            with gemv_gather_off() as testing:
                t["act-order gather-first"] = per_call_us(copies["imported act-order"], x)
            gather = per_call_us([lambda v: v.index_select(-1, perm)] * args.copies, x)
            row = dict(N=n, K=k, M=mtok, **{f"{label} us": v for label, v in t.items()}, **{"gather us": gather})
            row["imported / native"] = t["imported"] / t["native"]
            row["act-order / native"] = t["imported act-order"] / t["native"]
            row["gather-first / native"] = t["act-order gather-first"] / t["native"]
            row["in GEMV"] = bool(testing.gemv_gathers(mtok, n, k))
            rows.append(row)
            print(f"{n}x{k} M={mtok}: native {t['native']:.2f} us, imported {t['imported']:.2f} "
                  f"({row['imported / native']:.3f}x), act-order {t['imported act-order']:.2f} "
                  f"({row['act-order / native']:.3f}x, gathered {'in the GEMV' if row['in GEMV'] else 'first'}), "
                  f"gathered first {t['act-order gather-first']:.2f} ({row['gather-first / native']:.3f}x), "
                  f"gather alone {gather:.2f} us", flush=True)
        del copies
    result = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "command": command_line("bench_import", argv),
              "rows": rows}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    cols = ["N", "K", "M", "native us", "imported us", "imported act-order us", "in GEMV",
            "act-order gather-first us", "gather us", "imported / native", "act-order / native",
            "gather-first / native"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
