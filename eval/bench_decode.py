"""End-to-end decode benchmark: a plain-torch Llama decode step in one CUDA graph.

    python -m qgemv.eval.bench_decode --out runs/decode            # both models
    python -m qgemv.eval.bench_decode --models seed --batches 1    # quicker

Models (random weights, fp16, on the GPU):
  seed  : the NPU article's case study, 12 layers, hidden 4096, 32 heads
          (head dim 128), FFN 11008, vocab 32000;
  7b    : Llama-2-7B shapes, 32 layers, same widths.
Variants: fp16 (nn.Linear -> cuBLAS), int8 per-channel, int4 per-channel and
int4 g128.  All of them, fp16 included, have q/k/v and gate/up fused (one
launch each): the speedups measure quantization, not fusion.

Glue (--glue): the RMSNorms, residual adds, RoPE + cache write and SiLU*up
between the projections run either as eager torch ops (many small kernels in
the graph) or through torch.compile (a few fused Triton kernels, compiled once
per function and batch size; prefill always runs eager).

The decode step (RMSNorm, projections, RoPE, a static KV cache written at a
device-side position, SDPA over the cache, SwiGLU MLP, LM head) has static
shapes and is captured once per batch size in a CUDA graph; the position
tensor is advanced in place between replays.  Each run: a 128-token prompt
(prefill, untimed) then 256 decode steps; ms/token is the median over steps.

Reported per variant: ms/token, tokens/s, speedup vs fp16, the share of the
step spent in the linear layers (a graph of the same step's linear calls
alone, timed the same way), and the weight-bandwidth floor share (weight bytes
per token / read ceiling measured in this run) / step time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
from torch import nn
from torch.nn import functional as Fn


import qgemv  # noqa: E402
from .bench_gemv import Timer, command_line, graph_time, read_ceiling  # noqa: E402
from qgemv import formats  # noqa: E402

MODELS = {
    "seed": dict(layers=12, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000),
    "7b": dict(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000),
}
VARIANTS = {"fp16": None, "int8": (8, None), "int4": (4, None), "int4g128": (4, 128)}


class Block(nn.Module):
    def __init__(self, c, dev):
        super().__init__()
        h, hd = c["hidden"], c["hidden"] // c["heads"]
        mk = lambda i, o: nn.Linear(i, o, bias=False, device=dev, dtype=torch.float16)  # noqa: E731
        self.q_proj, self.k_proj, self.v_proj = mk(h, h), mk(h, c["kv_heads"] * hd), mk(h, c["kv_heads"] * hd)
        self.o_proj = mk(h, h)
        self.gate_proj, self.up_proj, self.down_proj = mk(h, c["ffn"]), mk(h, c["ffn"]), mk(c["ffn"], h)
        self.n1 = nn.Parameter(torch.ones(h, device=dev, dtype=torch.float16))
        self.n2 = nn.Parameter(torch.ones(h, device=dev, dtype=torch.float16))
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(lin.weight, std=0.02)


def rms(x, w, eps=1e-5):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope(x, cos, sin):
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


# The "glue" between the projections: everything in a layer that is not a
# linear layer or attention.  Eager, each line is one or more small kernels;
# with --compile-glue each function becomes one or two fused Triton kernels
# (torch.compile, shapes static), compiled once and shared by all layers.
def glue_rms(x, w):
    return rms(x, w)


def glue_add_rms(x, delta, w):
    """Residual add, then the next RMSNorm: (x + delta, rms(x + delta) * w)."""
    x = x + delta
    return x, rms(x, w)


def glue_rope_cache(q, k, v, cos, sin, k_cache, v_cache, positions):
    """RoPE on q and k; k and v written into the static cache at `positions`; returns rotated q."""
    k_cache.index_copy_(2, positions, rope(k, cos, sin))
    v_cache.index_copy_(2, positions, v)
    return rope(q, cos, sin)


def glue_swiglu(g, u):
    return Fn.silu(g) * u


GLUE = dict(rms=glue_rms, add_rms=glue_add_rms, rope_cache=glue_rope_cache, swiglu=glue_swiglu)


def fuse_fp16_projections(model) -> None:
    """fp16 baseline with the same fusion as the quantized variants: one q/k/v and one gate/up nn.Linear."""
    for b in model.blocks:
        for name, parts in (("wqkv", ("q_proj", "k_proj", "v_proj")), ("w_gate_up", ("gate_proj", "up_proj"))):
            ws = [getattr(b, n).weight for n in parts]
            lin = nn.Linear(ws[0].shape[1], sum(w.shape[0] for w in ws), bias=False, device=ws[0].device,
                            dtype=ws[0].dtype)
            with torch.no_grad():
                lin.weight.copy_(torch.cat(ws, 0))
            setattr(b, name, lin)
            setattr(b, name + "_sizes", [w.shape[0] for w in ws])
            for n in parts:
                delattr(b, n)


def _fused_out(b, fused_name, fp16_name, members, h):
    """Outputs of one fused projection, split into views (no copies), or the separate linears."""
    if hasattr(b, fused_name):  # qgemv.nn.fuse_llama_projections
        f = getattr(b, fused_name)
        y, offsets, sizes = f.fused(h), f.offsets, f.sizes
    elif hasattr(b, fp16_name):  # fuse_fp16_projections
        y, sizes = getattr(b, fp16_name)(h), getattr(b, fp16_name + "_sizes")
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    else:
        return [getattr(b, m)(h) for m in members]
    return [y[..., o : o + n] for o, n in zip(offsets, sizes)]


class Decoder(nn.Module):
    """A Llama decoder with a static KV cache; forward(ids [B, T], pos [1] int64 on device)."""

    def __init__(self, c, batch, max_ctx, dev):
        super().__init__()
        self.c, self.hd = c, c["hidden"] // c["heads"]
        self.embed = nn.Embedding(c["vocab"], c["hidden"], device=dev, dtype=torch.float16)
        self.blocks = nn.ModuleList(Block(c, dev) for _ in range(c["layers"]))
        self.norm = nn.Parameter(torch.ones(c["hidden"], device=dev, dtype=torch.float16))
        self.lm_head = nn.Linear(c["hidden"], c["vocab"], bias=False, device=dev, dtype=torch.float16)
        nn.init.normal_(self.lm_head.weight, std=0.02)
        nn.init.normal_(self.embed.weight, std=0.02)
        shape = (c["layers"], batch, c["kv_heads"], max_ctx, self.hd)
        self.k_cache = torch.zeros(shape, device=dev, dtype=torch.float16)
        self.v_cache = torch.zeros(shape, device=dev, dtype=torch.float16)
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2, device=dev).float() / self.hd))
        ang = torch.arange(max_ctx, device=dev).float()[:, None] * inv[None]
        emb = torch.cat([ang, ang], -1)
        self.cos, self.sin = emb.cos().half(), emb.sin().half()
        self.max_ctx = max_ctx
        self.glue = GLUE  # replaced by compiled versions for decode with --compile-glue

    def forward(self, ids, pos):
        B, T = ids.shape
        c, hd = self.c, self.hd
        g = self.glue if T == 1 else GLUE  # prefill runs eager: no compile for its shapes
        positions = pos + torch.arange(T, device=ids.device)
        cos, sin = self.cos[positions][None, None], self.sin[positions][None, None]
        # attend to cache slots <= position (a static-shape mask over max_ctx)
        slots = torch.arange(self.max_ctx, device=ids.device)
        mask = slots[None, :] <= positions[:, None]  # [T, max_ctx]
        x = self.embed(ids)
        h = g["rms"](x, self.blocks[0].n1)
        for i, b in enumerate(self.blocks):
            q, k, v = _fused_out(b, "qkv", "wqkv", ("q_proj", "k_proj", "v_proj"), h)
            q = q.view(B, T, c["heads"], hd).transpose(1, 2)
            k = k.view(B, T, c["kv_heads"], hd).transpose(1, 2)
            v = v.view(B, T, c["kv_heads"], hd).transpose(1, 2)
            q = g["rope_cache"](q, k, v, cos, sin, self.k_cache[i], self.v_cache[i], positions)
            a = Fn.scaled_dot_product_attention(q, self.k_cache[i], self.v_cache[i], attn_mask=mask[None, None])
            x, h = g["add_rms"](x, b.o_proj(a.transpose(1, 2).reshape(B, T, -1)), b.n2)
            gate, up = _fused_out(b, "gate_up", "w_gate_up", ("gate_proj", "up_proj"), h)
            nxt = self.blocks[i + 1].n1 if i + 1 < len(self.blocks) else self.norm
            x, h = g["add_rms"](x, b.down_proj(g["swiglu"](gate, up)), nxt)
        return self.lm_head(h[:, -1:])


def linears_only(model, x1, xf):
    """The step's linear calls alone (same shapes), for the 'share in linear layers' number."""
    for b in model.blocks:
        _fused_out(b, "qkv", "wqkv", ("q_proj", "k_proj", "v_proj"), x1)
        b.o_proj(x1)
        _fused_out(b, "gate_up", "w_gate_up", ("gate_proj", "up_proj"), x1)
        b.down_proj(xf)
    model.lm_head(x1)


_COMPILED_GLUE = {}


def compiled_glue():
    """GLUE through torch.compile (one compile per function and shape, shared by all layers and variants)."""
    if not _COMPILED_GLUE:
        for k, fn in GLUE.items():
            _COMPILED_GLUE[k] = torch.compile(fn, dynamic=False, fullgraph=True)
    return _COMPILED_GLUE


def weight_bytes(model) -> int:
    """Bytes of every linear's weight: packed (with scales and zeros) for QuantLinear, dense for nn.Linear."""
    n = 0
    for m in model.modules():
        if isinstance(m, qgemv.QuantLinear):
            n += formats.nbytes(m.qweight, m.scales, m.zeros)
        elif isinstance(m, nn.Linear):
            n += m.weight.numel() * m.weight.element_size()
    return n


KERNEL_KINDS = (  # (category, substrings of the kernel name), first match wins
    ("attention", ("decode_attention",)),  # qgemv's own (qgemv.ops.decode_attention)
    ("qgemv", ("qgemv",)),
    ("cuBLAS", ("gemm", "nvjet", "xmma", "cutlass", "gemv")),
    ("attention", ("fmha", "attention", "flash", "attn")),
    ("glue (Triton)", ("triton",)),
)


def kernel_breakdown(step, steps=5, per_kernel=False):
    """GPU time per decode step by kernel category (µs), from torch.profiler over `steps`
    eager calls of the step (the same kernels the graph replays, without the graph).
    per_kernel: also return {kernel name: [launches per step, µs per step]} of the 25 costliest."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    out, kernels = {}, {}
    for ev in prof.key_averages():
        if getattr(ev, "device_type", None) == torch.autograd.DeviceType.CPU:
            continue  # a CPU op: its device_time_total repeats its kernels' time
        us = getattr(ev, "device_time_total", None)
        if us is None:
            us = getattr(ev, "cuda_time_total", 0.0)
        if us <= 0:
            continue
        name = ev.key.lower()
        kind = next((k for k, subs in KERNEL_KINDS if any(v in name for v in subs)), "other")
        out[kind] = out.get(kind, 0.0) + us / steps
        kernels[ev.key[:120]] = [ev.count / steps, us / steps]
    if not per_kernel:
        return out
    return out, dict(sorted(kernels.items(), key=lambda kv: -kv[1][1])[:25])


def quantize_variant(model, bits, group):
    qgemv.nn.fuse_llama_projections(model, bits, group)
    qgemv.quantize_model(model, bits=bits, group_size=group, skip=("lm_head",))


@torch.no_grad()
def run_model(name, cfg, batches, read_gbps, glue="compiled", prompt=128, gen=256, pdl=(-1,), breakdown=False):
    """Decode timings of every variant; pdl: GEMV launch modes to time (qgemv._C.set_gemv_pdl), the
    first of which is the row's ms_per_token; breakdown: also profile the step's kernels by kind."""
    from qgemv import _C
    rows = []
    dev = "cuda"
    for batch in batches:
        base_ms = None
        for vname, q in VARIANTS.items():
            torch.manual_seed(0)
            model = Decoder(cfg, batch, prompt + gen + 8, dev)  # graph_time advances pos once per replay
            if q is not None:
                quantize_variant(model, *q)
            else:
                fuse_fp16_projections(model)
            if glue == "compiled":
                model.glue = compiled_glue()
            torch.cuda.empty_cache()
            ids = torch.randint(0, cfg["vocab"], (batch, prompt), device=dev)
            pos = torch.zeros(1, dtype=torch.long, device=dev)
            model(ids, pos)  # prefill: M = 128 x batch tokens (tiled GEMM at batch 1, dequantize + GEMM at 8)
            pos.fill_(prompt)
            tok = torch.randint(0, cfg["vocab"], (batch, 1), device=dev)
            out = {}

            def step():
                out["logits"] = model(tok, pos)

            def advance():
                pos.add_(1)

            # One graph per PDL mode (the launch attribute is fixed at capture);
            # the fp16 variant launches no GEMV, so it is timed once.
            pdl_modes = [-1] if q is None else pdl
            times = {}
            for mode in pdl_modes:
                _C.set_gemv_pdl(mode)
                pos.fill_(prompt)
                times[mode] = graph_time(step, replays=gen, before=advance)
            _C.set_gemv_pdl(-1)
            ms = times[pdl_modes[0]]
            x1 = torch.randn(batch, cfg["hidden"], device=dev, dtype=torch.float16)
            xf = torch.randn(batch, cfg["ffn"], device=dev, dtype=torch.float16)
            lin_ms = graph_time(lambda: linears_only(model, x1, xf), replays=50)
            wb = weight_bytes(model)
            floor_ms = wb / (read_gbps * 1e9) * 1e3
            if vname == "fp16":
                base_ms = ms
            kinds = kernel_breakdown(step) if breakdown else {}
            if kinds:
                busy = sum(kinds.values())
                print(f"{name:5s} b={batch} {vname:9s} kernels per step (µs): "
                      + ", ".join(f"{k} {v:.0f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
                      + f"; sum {busy:.0f} of {ms * 1e3:.0f} in the graph (gaps {ms * 1e3 - busy:.0f})", flush=True)
            rows.append(dict(model=name, batch=batch, variant=vname, glue=glue, ms_per_token=ms, tokens_per_s=batch * 1e3 / ms,
                             speedup_vs_fp16=base_ms / ms, linear_share=lin_ms / ms, weight_MB=wb / 1e6,
                             floor_share=floor_ms / ms, gemv_pdl_mode=pdl_modes[0],
                             ms_per_token_by_pdl_mode={str(k): v for k, v in times.items()},
                             kernel_us_per_step=kinds))
            extra = "".join(f"  [pdl {k}: {v:.3f} ms]" for k, v in times.items()) if len(times) > 1 else ""
            print(f"{name:5s} b={batch} {glue:8s} {vname:9s} {ms:7.3f} ms/token  {batch * 1e3 / ms:8.1f} tok/s  "
                  f"x{base_ms / ms:.2f}  linear {100 * lin_ms / ms:4.1f}%  floor {100 * floor_ms / ms:4.1f}%{extra}",
                  flush=True)
            del model, out
            torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="seed,7b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--glue", default="compiled", help="eager, compiled or eager,compiled (see GLUE)")
    ap.add_argument("--out", default="runs/bench_decode")
    ap.add_argument("--gemv-pdl", default="default",
                    help="programmatic dependent launch of the GEMV (qgemv._C.set_gemv_pdl): 'default', 'off', or a "
                         "comma list of modes (-1 default, 0 off, 1 + 2 prefetch + 4 release), each quantized step "
                         "captured and timed once per mode; the first gives the table's row")
    ap.add_argument("--breakdown", action="store_true",
                    help="also profile each step's kernels (torch.profiler, eager) and report GPU time by kind: "
                         "qgemv, cuBLAS, attention, Triton glue, other; the rest of the graph time is gaps")
    args = ap.parse_args(argv)
    pdl = {"default": (-1,), "off": (0,)}.get(args.gemv_pdl) or tuple(int(v) for v in args.gemv_pdl.split(","))
    if not torch.cuda.is_available():
        print("bench_decode: no CUDA GPU; nothing to measure")
        return 0
    ceiling = read_ceiling(Timer())
    rows = []
    for glue in args.glue.split(","):
        for name in args.models.split(","):
            rows += run_model(name, MODELS[name], [int(b) for b in args.batches.split(",")], ceiling["read_GBps"],
                              glue, pdl=pdl, breakdown=args.breakdown)
    result = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  command=command_line("bench_decode", argv), ceiling=ceiling, rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        keys = sorted({(r["model"], r["batch"], r["glue"]) for r in rows})
        fig, ax = plt.subplots(figsize=(8, 4))
        wdt = 0.8 / len(VARIANTS)
        for j, v in enumerate(VARIANTS):
            ax.bar([i + j * wdt for i in range(len(keys))],
                   [next(r["tokens_per_s"] for r in rows if (r["model"], r["batch"], r["glue"]) == k and r["variant"] == v)
                    for k in keys],
                   wdt, label=v)
        ax.set_xticks([i + 0.4 - wdt / 2 for i in range(len(keys))])
        ax.set_xticklabels([f"{m} b={b}\n{gl} glue" for m, b, gl in keys], fontsize=8)
        ax.set_ylabel("tokens / s")
        ax.set_title(f"decode, one CUDA graph per step, {torch.cuda.get_device_name()}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=110)
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
