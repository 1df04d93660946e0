"""Where the decode chain's attention time goes (issue 35, stage 2; lab, not installed).

    python dev/attn_probe.py [--layers 16] [--model llama3-8b|llama2-7b] [--heads H,HKV,D]
                             [--cases CTX:SPLITS[:PER_WARP[:FORM[:PF]]]],...]
                             [--no-base] [--stages 8[,4,...]]

Llama-3-8B (GQA 4) or Llama-2-7B (32 kv heads) shapes, int4 g128 + zeros: the
persistent chain with its norms only, then with attention at several
contexts, cache splits and positions a warp before a context is split
(PER_WARP, default 2, the launch's) and the attention's form (FORM: -1, the
default, the launch's rule; 1 an octet of lanes a position, 0 a warp a
position: testing.set_chain_attention_form) and the L2 prefetch at the attention
(PF: tiles a warp asks past its ring, forced; default 0, none; > 0 before the
block's units, < 0 after them: testing.set_chain_attention_prefetch); µs per
layer (CUDA graph replays, median), each row the extra over the norms-only chain.  The launch splits a
context only past PER_WARP positions a warp: the effective splits are printed.
--stages: the same for each ring depth (slots a warp): does attention's
cost a position fall when fewer weight bytes are in flight beside the
K / V reads (the rings refill during attention)?
"""

import argparse

import torch

import qgemv._ext
from qgemv import persist
from qgemv.eval.bench_chain import HEADS, MODELS, attention_for, dep_layers
from qgemv.eval.bench_gemv import graph_time

LLAMA2_7B = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)]  # q/k/v, o, gate/up, down


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--fmt", default="int4g128a")
    ap.add_argument("--model", default="llama3-8b", choices=("llama3-8b", "llama2-7b"))
    ap.add_argument("--heads", default="", help="HEADS,KV_HEADS,HEAD_DIM in place of the model's (q/k/v's rows "
                    "follow them, the other layers' shapes stay the model's)")
    ap.add_argument("--no-base", action="store_true", help="skip the norms-only chain (for ncu: the first "
                    "launches are then the first case's)")
    ap.add_argument("--stages", default=str(persist.DEFAULT_STAGES), help="ring slots a warp, a list")
    ap.add_argument("--cases", default="1:16,64:16:8,64:16,256:16:8,256:16,768:16:8,768:16,4096:16:8,"
                                        "4096:16")
    args = ap.parse_args()
    shapes = LLAMA2_7B if args.model == "llama2-7b" else MODELS["llama3-8b"][1]
    heads = (32, 32, 128) if args.model == "llama2-7b" else HEADS["llama3-8b"]
    if args.heads:  # q/k/v's rows follow the heads
        heads = tuple(int(v) for v in args.heads.split(","))
        shapes = [((heads[0] + 2 * heads[1]) * heads[2], shapes[0][1])] + list(shapes[1:])
    lay = dep_layers(args.fmt, args.layers, shapes)
    h = shapes[1][1]
    gains = [tuple((0.5 + torch.rand(h, device="cuda")).half() for _ in range(2)) for _ in lay]
    x = torch.randn(1, h, device="cuda", dtype=torch.float16)
    for stages in (int(v) for v in args.stages.split(",")):
        t0 = float("nan")
        if not args.no_base:
            base = persist.PersistentChain(lay, norms=gains, stages=stages)
            base(x)
            t0 = graph_time(base.run, replays=20) * 1e3 / args.layers
            del base
            print(f"{stages} stages, norms only: {t0:.1f} us/layer")
        for case in args.cases.split(","):
            parts = [int(v) for v in case.split(":")]
            ctx, splits, per_warp, form, pf = parts + [2, -1, 0][len(parts) - 2:]
            at = attention_for(heads, args.layers, ctx)
            at.splits, at.per_warp = splits, per_warp
            qgemv._ext.MODULE.testing.set_chain_attention_form(form)
            qgemv._ext.MODULE.testing.set_chain_attention_prefetch(pf)
            chain = persist.PersistentChain(lay, norms=gains, attention=at, stages=stages)
            chain(x, position=ctx - 1)
            t = graph_time(chain.run, replays=20) * 1e3 / args.layers
            eff = min(splits, -(-ctx // (chain.warps * per_warp)))  # as the kernel caps them
            print(f"{args.model} context {ctx:5d}, {eff:2d} splits a kv head ({-(-ctx // eff):4d} positions a "
                  f"unit), {per_warp} a warp, form {form}, prefetch {pf}, {stages} stages: {t:.1f} us/layer, "
                  f"+{t - t0:.1f}",
                  flush=True)
            del chain, at


if __name__ == "__main__":
    main()
