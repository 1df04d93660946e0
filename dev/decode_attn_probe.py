"""qgemv.ops.decode_attention against the engine's former per-op attention (SDPA over the whole cache with an
additive mask), one layer's call, on the GPU.

    python dev/decode_attn_probe.py [--cases B:H:KV:D:S:CTX,...] [--dtype float16] [--splits 1,2,3] [--stages 2,3,4]

For each case: µs a call (20 calls in one CUDA graph, the best of 5 replays; a batch-16 layer's K / V is
past L2, a batch-1 layer's is not: its numbers flatter both), the bytes each reads (decode_attention: the visible rows; SDPA: the whole cache) and the rate of
the visible bytes; the largest difference between the two outputs; then decode_attention's µs with each
count of --splits forced (0 is the kernel's own choice); with --stages, each stage count's µs (the kernel's K / V
tiles a block, testing.set_decode_attention_stages) at its chosen split count and at the forced ones, each
checked equal to the default's output bit for bit.  Exit 2 for a bad --cases.
"""
import argparse
import sys

import torch
from torch.nn import functional as Fn

import qgemv  # noqa: F401  (loads the kernels)
from qgemv import ops

CASES = "16:32:32:128:776:640,16:32:8:128:776:640,16:32:32:128:4096:640,1:32:32:128:776:640,4:32:8:128:4096:2000"


def timed(fn, n=20, reps=5):
    """µs a call: n calls captured in one CUDA graph (no launch overhead: a short kernel timed in a Python
    loop measured the host, ~20 µs a call), the graph replayed reps times, the best replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / n)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=CASES, help="B:heads:kv_heads:head_dim:max_seq:context, comma-separated")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--splits", default="1,2,3,4,5,6,8", help="split counts to time besides the chosen one")
    ap.add_argument("--stages", default="", help="stage counts (2..4) to time, e.g. 2,3,4 (empty: the default only)")
    args = ap.parse_args(argv)
    try:
        cases = [tuple(int(v) for v in c.split(":")) for c in args.cases.split(",")]
        assert all(len(c) == 6 and 1 <= c[5] <= c[4] for c in cases)
        splits = [int(v) for v in args.splits.split(",")] if args.splits else []
        assert all(1 <= n <= ops.DECODE_ATTN_MAX_SPLITS for n in splits)
        stages = [int(v) for v in args.stages.split(",")] if args.stages else []
        assert all(2 <= n <= 4 for n in stages)
    except (ValueError, AssertionError):
        print(f"decode_attn_probe: --cases wants B:H:KV:D:S:CTX with 1 <= CTX <= S, --splits counts in "
              f"1..{ops.DECODE_ATTN_MAX_SPLITS}, --stages counts in 2..4; got {args.cases!r}, {args.splits!r}, "
              f"{args.stages!r}", file=sys.stderr)
        return 2
    testing = qgemv._ext.MODULE.testing if stages else None
    dt = getattr(torch, args.dtype)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}")
    print("B   H  KV   D     S   ctx | decode_attention us (GB/s of visible K/V) | SDPA us (its bytes) | x | max diff")
    for B, H, KV, D, S, ctx in cases:
        q = torch.randn(B, H, D, device="cuda", dtype=dt)
        # copies of the cache, one call each in turn, so that the calls in a graph read past the 50-60 MB L2
        copies = max(1, min(8, -(-(200 << 20) // (2 * B * KV * S * D * 2))))
        kv = [(torch.randn(B, KV, S, D, device="cuda", dtype=dt), torch.randn(B, KV, S, D, device="cuda", dtype=dt))
              for _ in range(copies)]
        turn = [0]

        def cache():
            turn[0] = (turn[0] + 1) % copies
            return kv[turn[0]]
        slot = torch.tensor([ctx - 1], device="cuda")
        pad = torch.zeros(B, dtype=torch.long, device="cuda")
        keys = torch.arange(S, device="cuda")
        mask = torch.zeros(B, 1, 1, S, device="cuda", dtype=dt).masked_fill_(~(keys <= ctx - 1), float("-inf"))
        scale = D ** -0.5

        def ours(n=0):
            k, v = cache()
            return ops.decode_attention(q, k, v, slot, pad, scale, n, checked=True)

        def sdpa():
            k, v = cache()
            return Fn.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, scale=scale,
                                                   enable_gqa=H != KV)

        t_ours, t_sdpa = timed(ours), timed(sdpa)
        turn[0] = 0
        a = ours()
        turn[0] = 0
        diff = (a.float() - sdpa()[:, :, 0].float()).abs().max().item()
        vis = 2 * B * KV * ctx * D * q.element_size()
        print(f"{B:<3d} {H:<3d} {KV:<3d} {D:<3d} {S:5d} {ctx:5d} | {t_ours:8.1f} ({vis / t_ours / 1e3:6.0f}) | "
              f"{t_sdpa:8.1f} ({2 * B * KV * S * D * q.element_size() / t_sdpa / 1e3:6.0f} GB/s) | "
              f"{t_sdpa / t_ours:4.2f} | {diff:.1e}")
        if splits:
            print("    forced splits: " + ", ".join(f"{n}: {timed(lambda: ours(n)):.1f}" for n in splits))
        for st in stages:  # each stage count after the default, the same calls; the outputs compared bit for bit
            default = testing.decode_attention_stages()
            try:
                turn[0] = 0
                base = ours(1)  # (one forced split: the chosen count may differ between stage counts)
                testing.set_decode_attention_stages(st)
                turn[0] = 0
                same = torch.equal(ours(1), base)
                row = [f"chosen {vis / timed(ours) / 1e3:.0f} GB/s"] + [f"{n}: {timed(lambda: ours(n)):.1f}"
                                                                         for n in splits]
                print(f"    stages {st}: " + ", ".join(row) + ("" if same else "  OUTPUT DIFFERS FROM THE DEFAULT'S"))
            finally:
                testing.set_decode_attention_stages(default)
    return 0


if __name__ == "__main__":
    sys.exit(main())
