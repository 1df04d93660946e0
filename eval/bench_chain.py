"""Decode's GEMV chain: the linears of several decoder layers in one CUDA graph, against fp16 cuBLAS.

    python -m qgemv.eval.bench_chain --model llama3-8b --ms 1,4,16 --out runs/chain_llama3-8b

Each decoder layer's four linears (fused q/k/v, o, fused gate/up, down) get
their own random weights, so a chain of layers reads far more than the
60 MB L2 (Llama-3-8B: 16 layers, 1.7 GB in int4 and 7 GB in fp16).  All of
them are captured in one CUDA graph, replayed 20 times, and the median
replay is divided by the layer count: µs per layer, the weight bytes over
that time (GB/s), their share of the read ceiling measured in the same run
(torch's sum over 4 GiB), and the speed-up over fp16 cuBLAS in the same
kind of graph.  qgemv's variants run twice on compute capability 9.0+: as
plain launches and as programmatic dependent launches (``PDL``, mode 7 of
``qgemv._C.set_gemv_pdl``).  Peers, each where it imports: torch's tinygemm
int4 g128 (bf16) and int8 weight-only kernels; gemlite 0.6 int4 g128 with
zero points and int8 (``A16W4_HQQ_INT`` / ``A16W8_INT8``, Triton);
bitsandbytes NF4 (blocks of 64) and LLM.int8.  Writes <out>.json, <out>.md
and <out>.png.

The chain with real dependencies (M = 1 only), for int4, int4g128,
int4g128a, int8 and fp16 (the baseline: float16 weights): ``FMT_deps`` runs each
layer as the decode step chains it (q/k/v, o reading q's first H outputs plus
the residual, gate/up with SiLU * mul, down plus the residual;
qgemv.persist.reference: one qgemv kernel a linear, cuBLAS for fp16, the glue
in torch), and ``FMT_persist`` runs the same layers, the same weights, as
one persistent launch (qgemv.persist.PersistentChain, compute capability 9.x).
Their outputs are compared (``rel_err`` in the report: the largest difference
over the largest output).  Bytes per layer are the packed (or float16) weights' in both.
``--norms`` adds each layer's two RMSNorms (random gains) to both modes: torch
ops in ``FMT_deps``, the launch's hand-offs in ``FMT_persist``.
``--attention L`` (with the norms) replaces the stand-in for attention by the
real one at a context of L tokens (the token at slot L - 1 of an L-slot
cache): RoPE, the cache write and GQA attention, torch ops in ``FMT_deps``
(qgemv.persist.attend) and inside the launch in ``FMT_persist``; the bytes
then count each layer's K and V cache too.  ``FMT_bf16_deps`` /
``FMT_bf16_persist`` (and ``bf16_deps`` / ``bf16_persist``, bf16 weights):
the same chains with bfloat16 activations.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch

from .bench_gemv import Timer, command_line, graph_time, make_variant, read_ceiling

# (layers, [(N, K) of fused q/k/v, o, fused gate/up, down])
MODELS = {
    "llama3-8b": (16, [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]),
    "llama3-70b": (4, [(10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)]),
    "qwen2.5-7b": (16, [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)]),
}
# (heads, kv_heads, head_dim) for --attention
HEADS = {"llama3-8b": (32, 8, 128), "llama3-70b": (64, 8, 128), "qwen2.5-7b": (28, 4, 128)}
VARIANTS = ["fp16", "bf16", "int8", "int4", "int4g128", "int4g128a", "tinygemm_g128", "torch_int8",
            "gemlite_int4g128a", "gemlite_int8", "bnb_nf4", "bnb_int8",
            "int4_deps", "int4_persist", "int4g128_deps", "int4g128_persist", "int4g128a_deps", "int4g128a_persist",
            "int8_deps", "int8_persist", "fp16_deps", "fp16_persist"]
QGEMV = ("int8", "int4", "int4g128", "int4g128a")


def peer_variant(name: str, n: int, k: int):
    """(fn(x) -> y, weight bytes, activation dtype) of a peer library's layer; ImportError where it is missing."""
    w = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
    if name == "gemlite_int4g128a":
        from gemlite.helper import A16W4_HQQ_INT

        g = 128
        wf = w.float().view(n, k // g, g)
        lo, hi = wf.amin(-1), wf.amax(-1)
        s = (hi - lo).clamp(min=1e-6) / 15
        z = torch.round(-lo / s)
        q = torch.clamp(torch.round(wf / s[..., None]) + z[..., None], 0, 15).to(torch.uint8).view(n, k)
        lin = A16W4_HQQ_INT(device="cuda").from_weights(q, s.half(), z.half())  # w = (q - z) * s
        return lin, n * k // 2 + 2 * 2 * n * (k // g), torch.float16
    if name == "gemlite_int8":
        from gemlite.helper import A16W8_INT8

        return A16W8_INT8(device="cuda").from_weights(w), n * k + 4 * n, torch.float16
    if name == "bnb_nf4":
        import bitsandbytes as bnb

        w4, state = bnb.functional.quantize_4bit(w, blocksize=64, quant_type="nf4")
        return (lambda x: bnb.matmul_4bit(x, w4.t(), quant_state=state)), n * k // 2 + 4 * n * k // 64, torch.float16
    if name == "bnb_int8":
        import bitsandbytes as bnb

        lin = bnb.nn.Linear8bitLt(k, n, bias=False, has_fp16_weights=False)
        lin.weight = bnb.nn.Int8Params(w.cpu(), requires_grad=False, has_fp16_weights=False)
        return lin.cuda(), n * k + 4 * n, torch.float16
    raise ValueError(f"unknown variant {name}")


def dep_format(fmt: str):
    """(weight format, activations' dtype) of a dependent chain's FMT: a trailing "_bf16" (int4g128a_bf16) or
    "bf16" itself (bf16 weights) runs bfloat16 activations, the rest float16."""
    if fmt == "bf16":
        return "bf16", torch.bfloat16
    if fmt.endswith("_bf16"):
        return fmt[:-len("_bf16")], torch.bfloat16
    return fmt, torch.float16


def dep_layers(fmt: str, layers: int, shapes: list):
    """Random weights of a dependent chain: [(qkv, o, gate_up, down) PackedWeight, or float16 / bfloat16 tensors
    for "fp16" / "bf16"] on the GPU (gate_up: gate's rows, then up's); each linear maps activations of size 1 to
    about 0.3 (the chain stays finite in fp16)."""
    from qgemv import formats
    from qgemv.weight import PackedWeight

    from .bench_gemv import QCFG

    fmt = dep_format(fmt)[0]
    cfg = QCFG.get(fmt)

    def packed(n, k):
        w = torch.randn(n, k, device="cuda") * (0.3 / k ** 0.5)
        if fmt in ("fp16", "bf16"):
            return w.to(torch.bfloat16 if fmt == "bf16" else torch.float16)
        qw, s, z = formats.quantize(w, cfg)
        return PackedWeight(qw, s, z, cfg, k)

    (nqkv, h), _, (n_gu, _), (_, inter) = shapes
    return [(packed(nqkv, h), packed(h, h), packed(n_gu, h), packed(h, inter)) for _ in range(layers)]


def attention_for(heads: tuple, layers: int, context: int, dt=torch.float16):
    """A qgemv.persist.Attention with random caches of ``context`` slots and RoPE tables (theta 500000), dt."""
    from qgemv import persist

    h, hk, d = heads
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float32, device="cuda") / d))
    ang = torch.arange(context, dtype=torch.float32, device="cuda")[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], -1)
    kc = torch.randn(layers, hk, context, d, device="cuda").to(dt)
    return persist.Attention(h, hk, d, ang.cos().to(dt), ang.sin().to(dt), kc, torch.randn_like(kc))


def dep_rows(fmt: str, layers: int, shapes: list, names: list, ceiling: dict, fp16: dict,
             norms: bool = False, heads: tuple = None, context: int = 0) -> list:
    """Rows of FMT_deps and FMT_persist (whichever of them names holds), M = 1, one set of weights; norms:
    with each layer's two RMSNorms (gains 0.5-1.5); context: with attention at that context (heads: the
    model's (heads, kv_heads, head_dim))."""
    from qgemv import persist

    lay = dep_layers(fmt, layers, shapes)
    dt = dep_format(fmt)[1]
    nbytes = sum(w.nbytes for w in lay[0])  # PackedWeight.nbytes, or a tensor's
    h = shapes[1][1]
    x = torch.randn(1, h, device="cuda", dtype=dt)
    norms = norms or context > 0
    gains = [tuple((0.5 + torch.rand(h, device="cuda")).to(dt) for _ in range(2)) for _ in lay] if norms else None
    at = attention_for(heads, layers, context, dt) if context else None
    pos = context - 1
    if at is not None:
        nbytes += 2 * context * heads[1] * heads[2] * 2  # the layer's K and V at this context
    ref = persist.reference(lay, x, gains, attention=at, position=pos)
    rows = []
    for name in names:
        err = 0.0
        if name.endswith("_persist"):
            try:
                chain = persist.PersistentChain(lay, norms=gains, attention=at, dtype=dt)
            except persist.PersistError as e:
                print(f"{name}: unavailable ({e})", flush=True)
                continue
            y = chain(x, position=pos) if at is not None else chain(x)
            err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            us = graph_time(chain.run, replays=20) * 1e3 / layers
            del chain
        else:
            us = graph_time(lambda: persist.reference(lay, x, gains, attention=at, position=pos),
                            replays=20) * 1e3 / layers
        gbps = nbytes / us / 1e3
        label = name + (f"+attn{context}" if context else "+norms" if norms else "")
        row = dict(variant=label, M=1, us_per_layer=us, bytes_per_layer=nbytes, GBps=gbps,
                   pct_read_ceiling=100 * gbps / ceiling["read_GBps"], x_fp16=fp16.get(1, float("nan")) / us,
                   rel_err=err)
        rows.append(row)
        print(f"{label:24s} M= 1: {us:8.1f} us/layer  {gbps:6.0f} GB/s  {row['pct_read_ceiling']:5.1f}% of read  "
              f"{row['x_fp16']:.2f}x fp16  rel.err {err:.1e}", flush=True)
    return rows


def chain(name: str, layers: int, shapes: list):
    """(calls: [(fn, K)] for every linear of every layer, weight bytes per layer, activation dtype)."""
    calls, nbytes, dtype = [], 0, None
    for li in range(layers):
        for n, k in shapes:
            fn, b, dtype = (peer_variant if name.startswith(("gemlite", "bnb")) else make_variant)(name, n, k)
            calls.append((fn, k))
            if li == 0:
                nbytes += b
    return calls, nbytes, dtype


def time_chain(calls, m: int, dtype) -> float:
    """Median µs of one graph replay of every call, each on its own fixed input [m, K]."""
    xs = {k: torch.randn(m, k, device="cuda", dtype=dtype) for k in {k for _, k in calls}}

    def run():
        for fn, k in calls:
            fn(xs[k])

    return graph_time(run, replays=20) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers in the chain (default: the model's)")
    ap.add_argument("--out", default=None, help="report prefix (default runs/chain_MODEL)")
    ap.add_argument("--norms", action="store_true",
                    help="FMT_deps / FMT_persist: with each layer's two RMSNorms (torch ops / inside the launch)")
    ap.add_argument("--attention", type=int, default=0, metavar="L",
                    help="FMT_deps / FMT_persist: with the norms and each layer's attention at a context of L tokens")
    args = ap.parse_args(argv)
    if args.attention < 0:
        ap.error(f"--attention must be a context length >= 1, got {args.attention}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_chain needs a CUDA GPU")
    from qgemv import _C

    layers, shapes = MODELS[args.model]
    layers = args.layers or layers
    out = args.out or f"runs/chain_{args.model}"
    ms = [int(v) for v in args.ms.split(",")]
    ceiling = read_ceiling(Timer())
    pdl = torch.cuda.get_device_capability()[0] >= 9
    rows, fp16 = [], {}
    names = args.variants.split(",")
    done_deps = set()
    for name in names:
        if name.endswith(("_deps", "_persist")):  # the dependent chain, M = 1: both modes of a format at once
            fmt = name.rsplit("_", 1)[0]
            if fmt in done_deps:
                continue
            done_deps.add(fmt)
            if 1 not in ms:
                print(f"{fmt}_deps / _persist: M = 1 only, skipped", flush=True)
                continue
            rows += dep_rows(fmt, layers, shapes, [n for n in names if n in (fmt + "_deps", fmt + "_persist")],
                             ceiling, fp16, args.norms, HEADS[args.model], args.attention)
            torch.cuda.empty_cache()
            continue
        try:
            calls, nbytes, dtype = chain(name, layers, shapes)
        except Exception as e:  # a peer this torch build lacks
            print(f"{name}: unavailable ({type(e).__name__}: {str(e)[:100]})", flush=True)
            continue
        modes = [(-1, name)] + ([(7, name + " PDL")] if pdl and name in QGEMV else [])
        for mode, label in modes:
            if name in QGEMV:
                _C.set_gemv_pdl(mode)
            for m in ms:
                try:
                    us = time_chain(calls, m, dtype) / layers
                except Exception as e:
                    print(f"{label} M={m}: failed ({type(e).__name__}: {str(e)[:100]})", flush=True)
                    continue
                if name == "fp16":
                    fp16[m] = us
                gbps = nbytes / us / 1e3
                row = dict(variant=label, M=m, us_per_layer=us, bytes_per_layer=nbytes, GBps=gbps,
                           pct_read_ceiling=100 * gbps / ceiling["read_GBps"],
                           x_fp16=fp16.get(m, float("nan")) / us)
                rows.append(row)
                print(f"{label:18s} M={m:2d}: {us:8.1f} us/layer  {gbps:6.0f} GB/s  "
                      f"{row['pct_read_ceiling']:5.1f}% of read  {row['x_fp16']:.2f}x fp16", flush=True)
        _C.set_gemv_pdl(-1)
        del calls
        torch.cuda.empty_cache()
    result = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  command=command_line("bench_chain", argv),
                  model=args.model, layers=layers, shapes=shapes, ceiling=ceiling, rows=rows)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"{result['date']}, {result['gpu']}, torch {result['torch']}, `{result['command']}`; {args.model}, "
             f"{layers} layers; read ceiling {ceiling['read_GBps']:.0f} GB/s", "",
             "| variant | M | µs / layer | GB/s | % of read ceiling | × fp16 | rel. error |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        err = f"{r['rel_err']:.1e}" if "rel_err" in r else ""
        lines.append(f"| {r['variant']} | {r['M']} | {r['us_per_layer']:.1f} | {r['GBps']:.0f} | "
                     f"{r['pct_read_ceiling']:.1f} | {r['x_fp16']:.2f} | {err} |")
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    _plot(rows, ms, out + ".png", f"{args.model}, {layers} layers, {result['gpu']}")
    return 0


def _plot(rows, ms, path, title) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(len(ms), 1)
    for j, m in enumerate(ms):
        vals = [next((r["x_fp16"] for r in rows if r["variant"] == v and r["M"] == m), 0.0) for v in labels]
        ax.bar([i + j * width for i in range(len(labels))], vals, width, label=f"M = {m}")
    ax.set_xticks([i + width * (len(ms) - 1) / 2 for i in range(len(labels))])
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("× fp16 cuBLAS (chain in one CUDA graph)")
    ax.set_title(title, fontsize=9)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
