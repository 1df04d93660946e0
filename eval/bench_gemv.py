"""Kernel benchmark: qgemv int8/int4 GEMV vs cuBLAS fp16/bf16, tinygemm and torch int8.

    python -m qgemv.eval.bench_gemv --out runs/bench            # full table
    python -m qgemv.eval.bench_gemv --quick                     # two shapes

For every shape (N x K) and token count M it reports the median time of
CUDA-event-timed calls with L2 flushed before each call (a 256 MB buffer is
overwritten between calls, so no weight byte comes from the 60 MB L2), the
effective bandwidth (weight + scale + zero bytes / time), the share of the
read ceiling measured in the same run, and the speedup over fp16 cuBLAS.

Also: 4096x4096 M=1 under CUDA-graph replay (20 calls on rotating weight
copies per graph), the prefill sweep behind the M > 16 dispatch (chunks, tiled GEMM, dense, wgmma GEMM), and the
fp32 SGEMV family vs torch.matmul.  Writes <out>.json, <out>.md and a
roofline plot <out>_roofline.png.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys

import torch


import qgemv  # noqa: E402
from qgemv import formats  # noqa: E402

SHAPES = [(4096, 4096), (12288, 4096), (11008, 4096), (4096, 11008), (14336, 4096),
          (4096, 14336), (8192, 8192), (28672, 8192), (8192, 28672)]


def tp_shapes() -> list:
    """The per-rank shapes (N x K) of Llama-3-8B and Llama-3-70B's linears under tensor parallelism 2 / 4 / 8:
    q/k/v and gate/up split along N (column parallel), o and down along K (row parallel)."""
    shapes = []
    for hidden, kv, inter in ((4096, 1024, 14336), (8192, 1024, 28672)):
        for tp in (2, 4, 8):
            shapes += [((hidden + 2 * kv) // tp, hidden), (hidden, hidden // tp), (2 * inter // tp, hidden),
                       (hidden, inter // tp)]
    return list(dict.fromkeys(shapes))


VARIANTS = ["fp16", "bf16", "tinygemm_g128", "torch_int8", "int8", "int4", "int4g128", "int4g128a", "int4g32a"]
QCFG = {
    "int8": formats.QuantConfig(8),
    "int4": formats.QuantConfig(4),
    "int4g128": formats.QuantConfig(4, 128),
    "int4g128a": formats.QuantConfig(4, 128, False),
    "int4g32a": formats.QuantConfig(4, 32, False),
}


class Timer:
    """Median CUDA-event time of fn() with L2 flushed before every call."""

    def __init__(self, flush_mb: int = 256):
        self.flush = torch.empty(flush_mb * 2**20 // 4, dtype=torch.float32, device="cuda")

    def __call__(self, fn, iters: int = 50, warmup: int = 5) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            self.flush.fill_(1.0)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            times.append((s, e))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in times) * 1e3  # us


def read_ceiling(timer: Timer) -> dict:
    """Device read and copy bandwidth, measured now (GB/s)."""
    n = 2**30  # 4 GiB of fp32
    a = torch.ones(n, dtype=torch.float32, device="cuda")
    t_read = timer(lambda: a.sum(), iters=10, warmup=2)
    b = torch.empty(n // 2, dtype=torch.float32, device="cuda")
    t_copy = timer(lambda: b.copy_(a[: n // 2]), iters=10, warmup=2)
    del a, b
    return {"read_GBps": 4 * n / t_read / 1e3, "copy_GBps": 2 * 2 * n / t_copy / 1e3}


def make_variant(name, n, k):
    """-> (fn(x) -> y, bytes read for the weight, x dtype) or None if unavailable."""
    w = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
    if name in ("fp16", "bf16"):
        dt = torch.float16 if name == "fp16" else torch.bfloat16
        wt = w.to(dt)
        return (lambda x: torch.matmul(x, wt.t())), wt.numel() * 2, dt
    if name == "tinygemm_g128":
        # torch's int4 "tinygemm" path: bf16 activations, group 128, asymmetric.
        g = 128
        wf = w.float().view(n, k // g, g)
        lo, hi = wf.amin(-1), wf.amax(-1)
        scale = ((hi - lo).clamp(min=1e-6) / 15)
        q = torch.round((wf - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
        qu8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
        packed = torch._convert_weight_to_int4pack(qu8.contiguous(), 8)
        zero = lo + 8 * scale  # tinygemm's zero is the value at code 8
        sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        return (lambda x: torch._weight_int4pack_mm(x, packed, g, sz)), n * k // 2 + sz.numel() * 2, torch.bfloat16
    if name == "torch_int8":
        qw, s = formats.quantize_int8(w)
        q8 = qw[:, :k].contiguous()
        s16 = s.to(torch.float16)
        return (lambda x: torch._weight_int8pack_mm(x, q8, s16)), n * k + n * 2, torch.float16
    cfg = QCFG[name]
    qw, s, z = formats.quantize(w, cfg)
    lin = qgemv.QuantLinear.from_quantized(torch.nn.Linear(k, n, bias=False, device="meta"), cfg, qw, s, z)
    return lin, formats.nbytes(qw, s, z), torch.float16


def bench_shapes(timer, shapes, ms, variants, ceiling):
    rows = []
    for n, k in shapes:
        base = {}
        for name in variants:
            try:
                made = make_variant(name, n, k)
            except Exception as e:  # a baseline missing from this torch build
                print(f"  {name} {n}x{k}: unavailable ({type(e).__name__}: {str(e)[:80]})")
                continue
            fn, nbytes, dt = made
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=dt)
                try:
                    us = timer(lambda: fn(x))
                except Exception as e:
                    print(f"  {name} {n}x{k} M={m}: failed ({type(e).__name__}: {str(e)[:80]})")
                    continue
                gbps = nbytes / us / 1e3
                if name == "fp16":
                    base[m] = us
                rows.append(dict(variant=name, N=n, K=k, M=m, us=us, bytes=nbytes, GBps=gbps,
                                 pct_read_ceiling=100 * gbps / ceiling["read_GBps"],
                                 speedup_vs_fp16=base.get(m, float("nan")) / us,
                                 tflops=2 * m * n * k / us / 1e6))
            del made, fn
            torch.cuda.empty_cache()
    return rows


def command_line(module: str, argv=None) -> str:
    """The command a benchmark's report records: ``python -m qgemv.eval.MODULE`` and its arguments (argv, or
    the process's own when main() was called without them)."""
    return " ".join(["python -m qgemv.eval." + module] + list(sys.argv[1:] if argv is None else argv))


@contextlib.contextmanager
def gemv_gather_off():
    """Act-order perms gathered by their own kernel first instead of inside the GEMV, for A/B runs
    (qgemv._C.testing.set_gemv_gather); yields the extension's testing module."""
    mod = qgemv._ext.MODULE
    if mod is None:
        raise SystemExit(f"needs the compiled extension: {qgemv._ext.REASON}")
    mod.testing.set_gemv_gather(False)
    try:
        yield mod.testing
    finally:
        mod.testing.set_gemv_gather(True)


def graph_time(fn, replays=20, before=None) -> float:
    """Median ms of replaying one CUDA graph of fn() (captured after two warm-up calls).

    ``before`` runs on the host before every replay (e.g. to advance a
    device-side position tensor).
    """
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ts = []
    for _ in range(replays):
        if before:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        ts.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ts)


def bench_graph(n=4096, k=4096, copies=20):
    """Per-call time of M=1 under CUDA-graph replay, weights rotating through L2-busting copies.

    The qgemv variants are captured twice: with the default GEMV launch and
    as programmatic dependent launches with L2 prefetch and early release
    ("<name> PDL", mode 7 of qgemv._C.set_gemv_pdl; on cc >= 9.0 only).
    """
    from qgemv import _C

    out = {}
    for name in ["fp16", "int8", "int4", "int4g128"]:
        fns = [make_variant(name, n, k)[0] for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.float16)

        def all_calls():
            for f in fns:
                f(x)

        modes = [(-1, name)]
        if name != "fp16" and torch.cuda.get_device_capability()[0] >= 9:
            modes.append((7, name + " PDL"))
        for mode, label in modes:
            _C.set_gemv_pdl(mode)
            out[label] = graph_time(all_calls, replays=20) * 1e3 / copies
        _C.set_gemv_pdl(-1)
        del fns
    return out


def prefill_sweep(timer, shapes=((4096, 4096), (8192, 8192), (28672, 8192)),
                  ms=(17, 24, 32, 48, 64, 96, 128, 192, 256, 512, 1024, 2048),
                  variants=("int8", "int4", "int4g128"), wgmma_shapes=False):
    """M > 16: the dispatch as shipped, each of its paths forced (16-token
    GEMV chunks, up to M = 128; the tiled mma.sync GEMM, up to M = 512;
    dequantize + cuBLAS; the wgmma GEMM where it runs), and fp16 cuBLAS.
    wgmma_shapes: also each wgmma block shape forced (0: 64 tokens x 256
    rows; 1: 128 x 128, warp-specialized)."""
    from qgemv import _C

    old = _C.testing.get_prefill_path()
    paths = [("chunked_us", _C.testing.PREFILL_CHUNKS), ("tiled_us", _C.testing.PREFILL_TILED),
             ("dequant_gemm_us", _C.testing.PREFILL_DENSE)]
    if _C.wgmma_available():
        paths.append(("wgmma_us", _C.testing.PREFILL_WGMMA))
    rows = []
    try:
        for n, k in shapes:
            fp16 = make_variant("fp16", n, k)[0]
            for name in variants:
                lin = make_variant(name, n, k)[0]
                for m in ms:
                    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                    row = dict(variant=name, N=n, K=k, M=m)
                    _C.testing.set_prefill_path(-1)
                    row["default_us"] = timer(lambda: lin(x), iters=20)
                    for key, path in paths:
                        if (key == "chunked_us" and m > 128) or (key == "tiled_us" and m > 512):
                            continue
                        _C.testing.set_prefill_path(path)
                        row[key] = timer(lambda: lin(x), iters=20)
                    if wgmma_shapes and "wgmma_us" in row:
                        _C.testing.set_prefill_path(_C.testing.PREFILL_WGMMA)
                        try:
                            for i in range(_C.testing.wgmma_shape_count()):
                                _C.testing.set_wgmma_shape(i)
                                row[f"wgmma{i}_us"] = timer(lambda: lin(x), iters=20)
                        finally:
                            _C.testing.set_wgmma_shape(-1)
                    row["fp16_us"] = timer(lambda: fp16(x), iters=20)
                    row["vs_fp16"] = row["default_us"] / row["fp16_us"]
                    rows.append(row)
            del fp16, lin
            torch.cuda.empty_cache()
    finally:
        _C.testing.set_prefill_path(old)
    return rows


def bench_sgemv(timer, shapes=((28672, 8192), (4096, 4096), (16384, 16), (8192, 130))):
    rows = []
    for n, k in shapes:
        A = torch.randn(n, k, device="cuda")
        x = torch.randn(k, device="cuda")
        row = dict(N=n, K=k, bytes=A.numel() * 4)
        row["torch_us"] = timer(lambda: torch.matmul(A, x))
        for kern in ["auto", "k32", "k128", "k16"]:
            if (kern == "k16" and k > 16) or (kern == "k128" and k % 4):
                continue
            row[f"{kern}_us"] = timer(lambda: qgemv.sgemv(A, x, kernel=kern))
        rows.append(row)
        del A
    return rows


def roofline_png(rows, ceiling, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    bw = ceiling["read_GBps"] * 1e9
    ai = [0.25, 200]
    ax.plot(ai, [bw * a / 1e12 for a in ai], "k--", lw=1, label=f"read ceiling {ceiling['read_GBps']:.0f} GB/s")
    markers = dict(zip(VARIANTS, "os^vDP*Xh"))
    for name in VARIANTS:
        pts = [r for r in rows if r["variant"] == name]
        if not pts:
            continue
        ax.scatter([2 * r["M"] * r["N"] * r["K"] / r["bytes"] for r in pts], [r["tflops"] for r in pts],
                   marker=markers[name], label=name, s=28)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / weight byte)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(f"qgemv GEMV roofline, {torch.cuda.get_device_name()}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def markdown(result) -> str:
    out = [f"{result['date']}, {result['gpu']}, torch {result['torch']}, command: `{result['command']}`", "",
           f"Read ceiling measured in this run: {result['ceiling']['read_GBps']:.0f} GB/s "
           f"(copy {result['ceiling']['copy_GBps']:.0f} GB/s).", "",
           "| N x K | M | variant | us | GB/s | % read ceiling | vs fp16 |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        out.append(f"| {r['N']}x{r['K']} | {r['M']} | {r['variant']} | {r['us']:.1f} | {r['GBps']:.0f} | "
                   f"{r['pct_read_ceiling']:.0f}% | {r['speedup_vs_fp16']:.2f}x |")
    if result.get("graph"):
        out += ["", "4096x4096, M=1, per call under CUDA-graph replay (20 calls per graph, weights rotating):", ""]
        out += [f"- {k}: {v:.2f} us" for k, v in result["graph"].items()]
    if result.get("prefill"):
        shape_cols = [k for k in result["prefill"][0] if k.startswith("wgmma") and k[5].isdigit()]
        out += ["", "Prefill (M > 16): the shipped dispatch, then each path forced"
                + (" (wgmma block shapes: 0 = 64 tokens x 256 rows, 1 = 128 x 128 warp-specialized)"
                   if shape_cols else "") + ".", "",
                "| N x K | variant | M | default us | x fp16 | GEMV chunks us | tiled GEMM us | dequant+cuBLAS us "
                "| wgmma GEMM us | " + "".join(f"{c[:-3]} us | " for c in shape_cols) + "fp16 cuBLAS us |",
                "|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(shape_cols)]
        for r in result["prefill"]:
            f = lambda key: f"{r[key]:.1f}" if key in r else "-"  # noqa: E731
            out.append(f"| {r['N']}x{r['K']} | {r['variant']} | {r['M']} | {r['default_us']:.1f} | "
                       f"{r['vs_fp16']:.2f} | {f('chunked_us')} | {f('tiled_us')} | {f('dequant_gemm_us')} | "
                       f"{f('wgmma_us')} | " + "".join(f"{f(c)} | " for c in shape_cols) + f"{r['fp16_us']:.1f} |")
    if result.get("sgemv"):
        out += ["", "| SGEMV N x K | torch.matmul us | auto | k32 | k128 | k16 | auto GB/s |", "|---|---|---|---|---|---|---|"]
        for r in result["sgemv"]:
            f = lambda key: f"{r[key]:.1f}" if key in r else "-"  # noqa: E731
            out.append(f"| {r['N']}x{r['K']} | {f('torch_us')} | {f('auto_us')} | {f('k32_us')} | {f('k128_us')} | "
                       f"{f('k16_us')} | {r['bytes'] / r['auto_us'] / 1e3:.0f} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/bench_gemv")
    ap.add_argument("--quick", action="store_true", help="two shapes, M=1 and 16 only")
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--no-extras", action="store_true", help="skip graph, prefill and sgemv sections")
    ap.add_argument("--prefill-only", action="store_true",
                    help="only the ceiling and the prefill sweep (M > 16: chunks / tiled / dense / wgmma / fp16)")
    ap.add_argument("--wgmma-shapes", action="store_true",
                    help="in the prefill sweep, also time each wgmma block shape forced")
    ap.add_argument("--tp-shapes", action="store_true",
                    help="the tensor-parallel shards of Llama-3-8B / 70B (TP 2, 4, 8) instead of the whole linears; "
                         "fp16, int8, int4, int4g128a only")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemv: no CUDA GPU; nothing to measure")
        return 0
    from qgemv import _ext

    if _ext.BACKEND == "reference":
        print(f"bench_gemv: the CUDA extension is not loaded ({_ext.REASON})")
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    timer = Timer()
    ceiling = read_ceiling(timer)
    print(f"read ceiling {ceiling['read_GBps']:.0f} GB/s, copy {ceiling['copy_GBps']:.0f} GB/s")
    shapes = [(4096, 4096), (28672, 8192)] if args.quick else tp_shapes() if args.tp_shapes else SHAPES
    ms = [1, 16] if args.quick else [int(v) for v in args.ms.split(",")]
    variants = ["fp16", "int8", "int4", "int4g128a"] if args.tp_shapes else VARIANTS
    rows = [] if args.prefill_only else bench_shapes(timer, shapes, ms, variants, ceiling)
    result = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  command=command_line("bench_gemv", argv),
                  ceiling=ceiling, rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save():  # after every section, so that a later failure loses nothing
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=1)

    save()
    if args.prefill_only:
        result["prefill"] = prefill_sweep(timer, wgmma_shapes=args.wgmma_shapes)
        save()
    elif not args.no_extras:
        result["graph"] = bench_graph()
        save()
        result["prefill"] = prefill_sweep(timer, wgmma_shapes=args.wgmma_shapes)
        save()
        result["sgemv"] = bench_sgemv(timer)
        save()
    md = markdown(result)
    with open(args.out + ".md", "w") as f:
        f.write(md + "\n")
    try:
        if rows:
            roofline_png(rows, ceiling, args.out + "_roofline.png")
    except ImportError:
        print("matplotlib missing: no roofline plot")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
