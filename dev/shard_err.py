"""One case of tests/test_shard.py's CUDA check, with its numbers: the assembled shards' error against the
unsharded layer, as a fraction of the test's tolerance (atol 4e-3 x max|y|), and each side against the fp32
reference (qgemv.ops reference path), so that a failure says which side drifted.
    python3 dev/shard_err.py [NAME FMT ACT WORLD]   (default: 70b.down int4g128a mixed 8)"""
import sys

import torch

sys.path.insert(0, "tests")
import test_shard as ts  # noqa: E402
from qgemv.formats import QuantConfig  # noqa: E402

name, fmt, act, world = (sys.argv[1:5] if len(sys.argv) > 4 else ["70b.down", "int4g128a", "mixed", "8"])
act = {"mixed": "mixed", "True": True, "False": False}[act]
world = int(world)
n, k, _ = ts.REAL[name]
torch.manual_seed(0)
w = ts._random_packed(QuantConfig(*ts.FORMATS[fmt]), n, k, act, world)
dense = w.dequantize().float()
for m in (1, 5, 16):
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    whole = ts._run(w, x)
    got = ts.assembled(w, x, name, world)
    scale = whole.abs().max().item()
    err = (got - whole).abs().max().item()
    line = f"m={m}: max|y|={scale:.4g} err={err:.4g} = {err / (4e-3 * scale):.3f} of the tolerance"
    ref = x.float() @ dense.t()
    line += (f"; whole vs fp32 {(whole - ref).abs().max().item() / scale:.2e}, "
             f"shards vs fp32 {(got - ref).abs().max().item() / scale:.2e} (x max|y|)")
    print(line, flush=True)
