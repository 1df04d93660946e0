"""Bad input on the CUDA path (issue 20, section 3), each case in a child process.

These calls used to kill the Python process with a segmentation fault (the
int4-grouped checks) or to poison the CUDA context ("misaligned address":
every later CUDA call failed).  Each child makes the bad call, expects a
clear exception, then runs a CUDA op to prove the context is still usable;
a crash fails the test instead of ending the run.
"""

import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import requires_cuda

PRELUDE = """
import torch, qgemv
from qgemv import formats
torch.manual_seed(0)
def expect(fn, rule):
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        assert rule in str(e), f"message {str(e)!r} lacks {rule!r}"
    else:
        raise SystemExit("no error raised")
    torch.cuda.synchronize()
    assert torch.ones(4, device="cuda").sum().item() == 4  # the context survived
    print("ok")
"""

G128A = "qw, s, z = formats.quantize_int4(torch.randn(256, 4096, device='cuda'), 128, False)\n"
X4096 = "x = torch.randn(2, 4096, device='cuda', dtype=torch.float16)\n"

CASES = {
    "int4g_x_wider_than_k": G128A + "x = torch.randn(1, 4224, device='cuda', dtype=torch.float16)\n"
        "expect(lambda: qgemv.linear_int4_grouped(x, qw, s, z, 128, 4096), 'must equal in_features (4096), got 4224')",
    "int4g_group_96": G128A + X4096 +
        "expect(lambda: qgemv.linear_int4_grouped(x, qw, s, z, 96, 4096), 'group_size must be 32, 64 or 128, got 96')",
    "int4g_zeros_one_group_short": G128A + X4096 +
        "expect(lambda: qgemv.linear_int4_grouped(x, qw, s, z[:, :-1].contiguous(), 128, 4096), "
        "'zeros must have shape [256, 32], got [256, 31]')",
    "int4g_scales_one_group_short": G128A + X4096 +
        "expect(lambda: qgemv.linear_int4_grouped(x, qw, s[:, :-1].contiguous(), z, 128, 4096), "
        "'scales must have shape [256, 32]')",
    "int4g_k_not_divisible": G128A + "x = torch.randn(2, 4032, device='cuda', dtype=torch.float16)\n"
        "expect(lambda: qgemv.linear_int4_grouped(x, qw, s, z, 128, 4032), 'qweight.shape[1] must be')",
    "int8_x_56_of_64": "qw, s = formats.quantize_int8(torch.randn(64, 64, device='cuda'))\n"
        "x = torch.randn(3, 56, device='cuda', dtype=torch.float16)\n"
        "expect(lambda: qgemv.linear_int8(x, qw, s, 64), 'must equal in_features (64), got 56')",
    "int4_x_40_of_64": "qw, s, _ = formats.quantize_int4(torch.randn(64, 64, device='cuda'))\n"
        "x = torch.randn(3, 40, device='cuda', dtype=torch.float16)\n"
        "expect(lambda: qgemv.linear_int4(x, qw, s, 64), 'must equal in_features (64), got 40')",
    "int8_qweight_misaligned": "qw, s = formats.quantize_int8(torch.randn(256, 4096, device='cuda'))\n"
        "buf = torch.empty(qw.numel() + 4, dtype=torch.int8, device='cuda')\n"
        "v = buf[4:].view(256, 4096); v.copy_(qw)\n" + X4096 +
        "expect(lambda: qgemv.linear_int8(x, v, s, 4096), 'qweight must start on a 16-byte boundary')",
    "int4_qweight_misaligned": "qw, s, _ = formats.quantize_int4(torch.randn(256, 4096, device='cuda'))\n"
        "buf = torch.empty(qw.numel() + 1, dtype=torch.int32, device='cuda')\n"
        "v = buf[1:].view(qw.shape); v.copy_(qw)\n" + X4096 +
        "expect(lambda: qgemv.linear_int4(x, v, s, 4096), 'qweight must start on a 16-byte boundary')",
    "int4g_qweight_misaligned_prefill": G128A +
        "buf = torch.empty(qw.numel() + 2, dtype=torch.int32, device='cuda')\n"
        "v = buf[2:].view(qw.shape); v.copy_(qw)\n"
        "x = torch.randn(300, 4096, device='cuda', dtype=torch.float16)\n"
        "expect(lambda: qgemv.linear_int4_grouped(x, v, s, z, 128, 4096), 'qweight must start on a 16-byte boundary')",
    "int8_x_on_cpu": "qw, s = formats.quantize_int8(torch.randn(64, 64, device='cuda'))\n"
        "expect(lambda: qgemv.linear_int8(torch.randn(1, 64, dtype=torch.float16), qw, s, 64), "
        "'must be on the same device as x')",
    # decode attention's layout rules (the kernel's own, checked first by the wrapper)
    "decode_attention_strided_cache": "q = torch.zeros(2, 4, 64, device='cuda', dtype=torch.float16)\n"
        "k = torch.zeros(2, 2, 64, 10, device='cuda', dtype=torch.float16).transpose(2, 3)\n"
        "slot, pad = torch.tensor([3], device='cuda'), torch.zeros(2, dtype=torch.long, device='cuda')\n"
        "expect(lambda: qgemv.ops.decode_attention(q, k, k, slot, pad, 0.125), 'k_cache must have contiguous rows')",
    "decode_attention_misaligned_cache": "q = torch.zeros(2, 4, 64, device='cuda', dtype=torch.float16)\n"
        "buf = torch.zeros(2 * 2 * 10 * 64 + 8, device='cuda', dtype=torch.float16)\n"
        "k = buf[1:1 + 2 * 2 * 10 * 64].view(2, 2, 10, 64)\n"
        "slot, pad = torch.tensor([3], device='cuda'), torch.zeros(2, dtype=torch.long, device='cuda')\n"
        "expect(lambda: qgemv.ops.decode_attention(q, k, k, slot, pad, 0.125), 'must start on a 16-byte boundary')",
}


@requires_cuda
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_cuda_call_raises_and_the_context_survives(case):
    code = PRELUDE + textwrap.dedent(CASES[case])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (
        f"exit {r.returncode} (negative: killed by signal {-r.returncode})\n{r.stdout}\n{r.stderr[-2000:]}")


@requires_cuda
def test_aligned_views_with_a_storage_offset_still_compute():
    """A qweight view 16 bytes into its storage is aligned and must give the same result."""
    from qgemv import formats

    import qgemv

    qw, s, z = formats.quantize_int4(torch.randn(256, 1024, device="cuda"), 128, False)
    buf = torch.empty(qw.numel() + 4, dtype=torch.int32, device="cuda")
    v = buf[4:].view(qw.shape)
    v.copy_(qw)
    x = torch.randn(3, 1024, device="cuda", dtype=torch.float16)
    assert torch.equal(qgemv.linear_int4_grouped(x, v, s, z, 128, 1024), qgemv.linear_int4_grouped(x, qw, s, z, 128, 1024))
