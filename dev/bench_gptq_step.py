"""A/B of GPTQ's column solve: one Llama-2-7B layer's four solves with two versions of calibration/gptq.py.

    python dev/bench_gptq_step.py OLD.py [NEW.py] [--device cuda] [--act-order] [--reps 2]

Each version is loaded from its file (NEW defaults to calibration/gptq.py) and
runs gptq_quantize on the stacked q/k/v (12288x4096), o (4096x4096), the
stacked gate/up (22016x4096) and down (4096x11008), int4 g128 with zero points,
with Hessians of random inputs; the medians of --reps runs per solve, and
whether the two versions' codes, scales and zeros are equal.
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import torch

from qgemv.formats import QuantConfig

SOLVES_FULL = [("qkv", 12288, 4096), ("o", 4096, 4096), ("gate_up", 22016, 4096), ("down", 4096, 11008)]
SOLVES_SMALL = [("qkv", 384, 512), ("down", 128, 1024)]  # --small: a quick check on the CPU


def load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old")
    ap.add_argument("new", nargs="?", default="calibration/gptq.py")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--act-order", action="store_true")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    mods = {"old": load(args.old, "gptq_old"), "new": load(args.new, "gptq_new")}
    cfg = QuantConfig(bits=4, group_size=128, symmetric=False)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator(device=dev).manual_seed(0)
    total = {v: 0.0 for v in mods}
    for name, n, k in SOLVES_SMALL if args.small else SOLVES_FULL:
        x = torch.randn(4096, k, device=dev, generator=g)
        H = x.T @ x / x.shape[0]
        W = torch.randn(n, k, device=dev, generator=g) * 0.02
        res, times = {}, {}
        for v, mod in mods.items():
            ts = []
            for _ in range(args.reps):
                sync()
                t = time.perf_counter()
                res[v] = mod.gptq_quantize(W, H, cfg, act_order=args.act_order, name=name)
                sync()
                ts.append(time.perf_counter() - t)
            times[v] = sorted(ts)[len(ts) // 2]
            total[v] += times[v]
        same = all(torch.equal(a, b) for a, b in zip(res["old"][:3], res["new"][:3]))
        print(f"{name:8s} {n:6d}x{k:<6d} old {times['old']:7.3f} s  new {times['new']:7.3f} s  "
              f"({times['old'] / times['new']:.2f}x)  identical: {same}", flush=True)
    print(f"one layer: old {total['old']:.2f} s, new {total['new']:.2f} s ({total['old'] / total['new']:.2f}x); "
          f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
