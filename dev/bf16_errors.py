"""The bf16 launch's measured errors (issue 35; the tests' tolerances): the chain against the per-op chain as a
share of what the layers add (test_persist's measure), and the engine's logits against the per-op engine's
(test_engine's measure: relative error, the share of clear top-2 margins, argmax mismatches there)."""
import math
import sys

import torch

sys.path.insert(0, "tests")
import test_engine as te  # noqa: E402
import test_persist as tp  # noqa: E402
from qgemv import persist  # noqa: E402

for dt in (torch.float16, torch.bfloat16):
    for name in ("int4", "int4g128a", "int4g32a", "int8", "fp16" if dt == torch.float16 else "bf16"):
        worst = 0.0
        layers = tp.make_layers(name, 3, 256, 384, 640, "cuda")
        norms = tp.random_norms(3, 256, dt)
        for ns in (None, norms):
            chain = persist.PersistentChain(layers, norms=ns, dtype=dt)
            for trial in range(3):
                x = torch.randn(1, 256, device="cuda", dtype=dt)
                y, ref = chain(x), persist.reference(layers, x, ns)
                added = (ref.float() - x.float()).abs().max().item()
                bits = 7 if dt == torch.bfloat16 else 10
                step = 2.0 ** (math.floor(math.log2(ref.float().abs().max().item())) - bits)
                worst = max(worst, ((y.float() - ref.float()).abs().max().item() - 2 * step) / added)
        print(f"chain {name:10s} {str(dt)[6:]:9s}: error - 2 steps = {worst:.4f} of what the layers add", flush=True)
for dt in (torch.float16, torch.bfloat16):
    for fmt in ((4, None, True), (4, 128, False), (8, None, True), None):
        model = te.megakernel_model("qwen3-qk-norm", 4, 2, fmt).to(dt).cuda()
        for plen, n in ((9, 24), (100, 28)):
            per_op, mk, ref, got = te.megakernel_pair(model, plen, n)
            err = (got - ref).abs().max().item() / ref.abs().max().item()
            top = ref.topk(2, -1).values
            gap = top[..., 0] - top[..., 1]
            out = []
            for m in (0.25, 0.5, 1.0):
                clear = gap > m
                bad = int((got.argmax(-1)[clear] != ref.argmax(-1)[clear]).sum())
                out.append(f"margin {m}: {clear.float().mean().item():.2f} clear, {bad} differ")
            print(f"engine {str(fmt):18s} {str(dt)[6:]:9s} prompt {plen}: rel err {err:.2e}; " + "; ".join(out),
                  flush=True)
