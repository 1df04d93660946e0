"""One case of tests/test_shard.py's CUDA check, with its numbers: the assembled shards' error against the
unsharded layer, as a fraction of the test's tolerance (atol 4e-3 x max|y|), and each side against the fp32
reference (qgemv.ops reference path), so that a failure says which side drifted.
    python3 dev/shard_err.py [NAME FMT ACT WORLD]   (default: 70b.down int4g128a mixed 8)"""
import sys

import torch

sys.path.insert(0, "tests")
import test_shard as ts  # noqa: E402
from qgemv import shard  # noqa: E402
from qgemv.formats import QuantConfig  # noqa: E402

name, fmt, act, world = (sys.argv[1:5] if len(sys.argv) > 4 else ["70b.down", "int4g128a", "mixed", "8"])
act = {"mixed": "mixed", "True": True, "False": False}[act]
world = int(world)
n, k, kind = ts.REAL[name]
bits, group, sym = ts.FORMATS[fmt]
torch.manual_seed(0)
w = ts._random_packed(QuantConfig(bits, group, sym), n, k, act, world)
dense = w.dequantize().float() if hasattr(w, "dequantize") else None
for m in (1, 5, 16):
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    whole = ts._run(w, x)
    if kind == "column":
        got = torch.cat([ts._run(w.shard_column(r, world, name), x) for r in range(world)], dim=-1)
    elif shard.row_needs_gather(w, world, name):
        got = 0
        for r in range(world):
            piece, index = shard.shard_row_gathered(w, r, world, name)
            got = got + ts._run(piece, x[:, index])
    else:
        got = sum(ts._run(w.shard_row(r, world, name), x[:, r * k // world:(r + 1) * k // world])
                  for r in range(world))
    scale = whole.abs().max().item()
    err = (got - whole).abs().max().item()
    line = f"m={m}: max|y|={scale:.4g} err={err:.4g} = {err / (4e-3 * scale):.3f} of the tolerance"
    if dense is not None:
        ref = x.float() @ dense.t()
        line += (f"; whole vs fp32 {(whole - ref).abs().max().item() / scale:.2e}, "
                 f"shards vs fp32 {(got - ref).abs().max().item() / scale:.2e} (x max|y|)")
    print(line, flush=True)
