"""The engine's norm with an act-order gather, in several forms, timed on the GPU (an experiment).

    python dev/glue_gather_probe.py [--width 4096] [--batches 1,4]

"after": qgemv.engine.glue_add_rms_gather as it is (RMSNorm, then the
normalized row gathered by perm).  "before": the row gathered first and
normalized after (x[perm] and w[perm]; the mean of squares does not depend
on the order), which Inductor can emit as one kernel with indirect loads,
where "after" may need a second kernel for the gather.  "op": qgemv::add_rms_gather, the
one CUDA kernel the engine now runs (written after the first run of this
probe: "after" took 3.06 us and 2 kernels at batch 1, "before" 6.53 and 2,
"none" 1.78 and 1).  "none": the norm without a gather.  Each compiled function is captured 200 times in one CUDA
graph; median us per call of 20 replays, and the CUDA kernels one call
launches (torch.profiler).
"""

from __future__ import annotations

import argparse

import torch

from qgemv.engine import _rms, glue_add_rms, glue_add_rms_gather


def gather_before(x, delta, w, perm, eps: float):
    x = x + delta
    return x, _rms(x.index_select(-1, perm), w.index_select(-1, perm), eps)


def kernels(fn, *args) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def per_call_us(fn, *args, calls: int = 200, reps: int = 20) -> float:
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn(*args)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--batches", default="1,4")
    args = ap.parse_args()
    torch._dynamo.config.recompile_limit = 64
    forms = {"none": torch.compile(glue_add_rms, dynamic=False, fullgraph=True),
             "op": lambda x, d, w, p, eps: torch.ops.qgemv.add_rms_gather(x, d, w, p, eps),
             "after": torch.compile(glue_add_rms_gather, dynamic=False, fullgraph=True),
             "before": torch.compile(gather_before, dynamic=False, fullgraph=True)}
    k = args.width
    perm = torch.randperm(k, device="cuda", dtype=torch.int32)
    w = torch.rand(k, device="cuda", dtype=torch.float16) + 0.5
    for b in (int(s) for s in args.batches.split(",")):
        x = torch.randn(b, 1, k, device="cuda", dtype=torch.float16)
        d = torch.randn_like(x)
        ref = glue_add_rms_gather(x, d, w, perm, 1e-5)[1]
        for name, fn in forms.items():
            a = (x, d, w, 1e-5) if name == "none" else (x, d, w, perm, 1e-5)
            out = fn(*a)[1]
            err = (out.float() - ref.float()).abs().max().item() if name != "none" else float("nan")
            print(f"batch {b} width {k} {name:6s}: {per_call_us(fn, *a):6.2f} us/call, {kernels(fn, *a)} kernels, "
                  f"max |diff| to eager {err:.3g}", flush=True)


if __name__ == "__main__":
    main()
