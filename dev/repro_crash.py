"""Which CUDA error paths crash (issue 20): each case in a child process, rc < 0 means a signal."""
import subprocess, sys

PRE = """
import torch, qgemv
from qgemv import formats as F
torch.manual_seed(0)
qw, s, z = F.quantize_int4(torch.randn(256, 4096, device='cuda'), 128, False)
x = torch.randn(1, 4096, device='cuda', dtype=torch.float16)
op = torch.ops.qgemv.linear_int4_grouped.default
"""
CASES = {
    "g96_zeros": "op(x, qw, s, z, 96, 4096)",
    "g96_no_zeros": "op(x, qw, s, None, 96, 4096)",
    "g96_zeros_inference_mode": "with torch.inference_mode(): op(x, qw, s, z, 96, 4096)",
    "g96_zeros_no_grad": "with torch.no_grad(): op(x, qw, s, z, 96, 4096)",
    "g96_redispatch_cuda": "op.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA), x, qw, s, z, 96, 4096)",
    "int4_bad_k_control": "torch.ops.qgemv.linear_int4(x, F.quantize_int4(torch.randn(8, 4096, device='cuda'))[0], s[:8, 0].contiguous(), 4032)",
}
for name, code in CASES.items():
    r = subprocess.run([sys.executable, "-c", PRE + code], capture_output=True, text=True, timeout=120)
    tail = (r.stderr.strip().splitlines() or [""])[-1][:200]
    print(f"{name:28s} rc={r.returncode:4d} err={tail!r}")
