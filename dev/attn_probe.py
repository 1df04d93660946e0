"""Where the decode chain's attention time goes (issue 35, stage 2; lab, not installed).

    python dev/attn_probe.py [--layers 16]

Llama-3-8B shapes, int4 g128 + zeros: the persistent chain with its norms
only, then with attention at several contexts and cache splits; µs per layer
(CUDA graph replays, median), each row the extra over the norms-only chain.
"""

import argparse

import torch

from qgemv import persist
from qgemv.eval.bench_chain import HEADS, MODELS, attention_for, dep_layers
from qgemv.eval.bench_gemv import graph_time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--fmt", default="int4g128a")
    ap.add_argument("--cases", default="1:16,64:16,768:16,768:8,768:4,4096:16,4096:8")
    args = ap.parse_args()
    _, shapes = MODELS["llama3-8b"]
    lay = dep_layers(args.fmt, args.layers, shapes)
    h = shapes[1][1]
    gains = [tuple((0.5 + torch.rand(h, device="cuda")).half() for _ in range(2)) for _ in lay]
    x = torch.randn(1, h, device="cuda", dtype=torch.float16)
    base = persist.PersistentChain(lay, norms=gains)
    base(x)
    t0 = graph_time(base.run, replays=20) * 1e3 / args.layers
    del base
    print(f"norms only: {t0:.1f} us/layer")
    for case in args.cases.split(","):
        ctx, splits = (int(v) for v in case.split(":"))
        at = attention_for(HEADS["llama3-8b"], args.layers, ctx)
        at.splits = splits
        chain = persist.PersistentChain(lay, norms=gains, attention=at)
        chain(x, position=ctx - 1)
        t = graph_time(chain.run, replays=20) * 1e3 / args.layers
        print(f"context {ctx:5d}, {splits:2d} splits a kv head ({(ctx + splits - 1) // splits:4d} positions a unit): "
              f"{t:.1f} us/layer, +{t - t0:.1f}")
        del chain, at


if __name__ == "__main__":
    main()
