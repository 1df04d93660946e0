"""qgemv.ops.decode_attention against the engine's former per-op attention (SDPA over the whole cache with an
additive mask), one layer's call, on the GPU.

    python dev/decode_attn_probe.py [--cases B:H:KV:D:S:CTX,...] [--dtype float16]

For each case: µs a call (CUDA events over 50 calls after 5 warm-ups; a layer's K / V of these sizes is far
past L2), the bytes each reads (decode_attention: the visible rows; SDPA: the whole cache) and the rate of
the visible bytes; the largest difference between the two outputs.  Exit 2 for a bad --cases.
"""
import argparse
import sys

import torch
from torch.nn import functional as Fn

import qgemv  # noqa: F401  (loads the kernels)
from qgemv import ops

CASES = "16:32:32:128:776:640,16:32:8:128:776:640,16:32:32:128:4096:640,1:32:32:128:776:640,4:32:8:128:4096:2000"


def timed(fn, n=50):
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=CASES, help="B:heads:kv_heads:head_dim:max_seq:context, comma-separated")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    args = ap.parse_args(argv)
    try:
        cases = [tuple(int(v) for v in c.split(":")) for c in args.cases.split(",")]
        assert all(len(c) == 6 and 1 <= c[5] <= c[4] for c in cases)
    except (ValueError, AssertionError):
        print(f"decode_attn_probe: --cases wants B:H:KV:D:S:CTX with 1 <= CTX <= S, got {args.cases!r}",
              file=sys.stderr)
        return 2
    dt = getattr(torch, args.dtype)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}")
    print("B   H  KV   D     S   ctx | decode_attention us (GB/s of visible K/V) | SDPA us (its bytes) | x | max diff")
    for B, H, KV, D, S, ctx in cases:
        q = torch.randn(B, H, D, device="cuda", dtype=dt)
        k = torch.randn(B, KV, S, D, device="cuda", dtype=dt)
        v = torch.randn(B, KV, S, D, device="cuda", dtype=dt)
        slot = torch.tensor([ctx - 1], device="cuda")
        pad = torch.zeros(B, dtype=torch.long, device="cuda")
        keys = torch.arange(S, device="cuda")
        mask = torch.zeros(B, 1, 1, S, device="cuda", dtype=dt).masked_fill_(~(keys <= ctx - 1), float("-inf"))
        scale = D ** -0.5

        def ours():
            return ops.decode_attention(q, k, v, slot, pad, scale, checked=True)

        def sdpa():
            return Fn.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, scale=scale,
                                                   enable_gqa=H != KV)

        t_ours, t_sdpa = timed(ours), timed(sdpa)
        diff = (ours().float() - sdpa()[:, :, 0].float()).abs().max().item()
        vis = 2 * B * KV * ctx * D * q.element_size()
        print(f"{B:<3d} {H:<3d} {KV:<3d} {D:<3d} {S:5d} {ctx:5d} | {t_ours:8.1f} ({vis / t_ours / 1e3:6.0f}) | "
              f"{t_sdpa:8.1f} ({2 * B * KV * S * D * q.element_size() / t_sdpa / 1e3:6.0f} GB/s) | "
              f"{t_sdpa / t_ours:4.2f} | {diff:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
