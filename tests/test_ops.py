"""The ops' contract on every device: results against float math, every
bad-input error, opcheck, act-order perms.  Parametrized over format x
device (the CPU reference always, the CUDA kernels where there is a GPU);
the CUDA kernels' paths, shapes and tight bounds are in test_cuda.py."""

import pytest
import torch

import qgemv
from qgemv import formats

from conftest import DEVICES, FORMATS, poison_like, quantized_linear, requires_cuda

# Loose tolerances: quantized weights vs the float weights they came from,
# relative Frobenius error of y on gaussian W and x.  RTN error per weight is
# uniform in +-s/2 (std s/sqrt(12)); with s = amax/127 (int8, amax ~ 4.3 sigma
# for 4096-ish samples), amax/7 (int4 per channel) or the group's amax/7
# (~2.9 sigma for 128 samples, ~2.4 for 32) the expected relative error is
# ~0.010, ~0.18, ~0.12 and ~0.10.  Bounds are ~1.5-2x those.
# Asymmetric groups (zero points) fit better than symmetric ones of the same size.
LOOSE = {"int8": 0.02, "int4": 0.3, "int4g128": 0.2, "int4g128a": 0.2, "int4g64": 0.17, "int4g64a": 0.15,
         "int4g32": 0.17, "int4g32a": 0.15}
CFGS = FORMATS
_call = quantized_linear


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CFGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_close_to_float_weights(name, dtype, device):
    cfg = CFGS[name]
    n, k = 96, 1024
    w = torch.randn(n, k)
    x = torch.randn(2, 3, k)
    qw, s, z = (t if t is None else t.to(device) for t in formats.quantize(w, cfg))
    y = _call(cfg, x.to(device, dtype), qw, s, z)
    assert y.shape == (2, 3, n) and y.dtype == dtype and y.device.type == device
    ref = x @ w.t()
    rel = ((y.float().cpu() - ref).norm() / ref.norm()).item()
    assert rel < LOOSE[name], rel


@pytest.mark.parametrize("name", list(CFGS))
def test_reference_equals_dequantized_matmul(name):
    # Tight: same quantized weights, fp64 math; the reference works in fp32
    # (the CUDA kernels' bounds: test_cuda.py).
    cfg = CFGS[name]
    n, k = 13, 256
    qw, s, z = formats.quantize(torch.randn(n, k), cfg)
    x = torch.randn(5, k)
    wd = formats.dequantize(qw, s, z, cfg, k).double()
    ref = x.double() @ wd.t()
    y = _call(cfg, x, qw, s, z).double()
    bound = 1e-5 * (x.double().abs() @ wd.abs().t()) + 1e-6
    assert ((y - ref).abs() <= bound).all()


def _int8_args(k=64, n=8, device="cpu"):
    qw, s = formats.quantize_int8(torch.randn(n, k))
    return torch.randn(3, k, dtype=torch.float16, device=device), qw.to(device), s.to(device)


def _int4g_args(k=64, n=8, device="cpu"):
    qw, s, z = formats.quantize_int4(torch.randn(n, k), 32, False)
    return torch.randn(3, k, dtype=torch.float16, device=device), qw.to(device), s.to(device), z.to(device)


# The checks run before dispatch: the same errors, word for word, on every device.
@pytest.mark.parametrize("device", DEVICES)
def test_errors_int8(device):
    x, qw, s = _int8_args(device=device)
    op = qgemv.linear_int8
    with pytest.raises(ValueError, match=r"qgemv.linear_int8: x must be float16, bfloat16 or float32, got torch.int32"):
        op(x.int(), qw, s, 64)
    with pytest.raises(ValueError, match=r"qgemv.linear_int8: qweight must be int8, got torch.int32"):
        op(x, qw.int(), s, 64)
    with pytest.raises(ValueError, match=r"qgemv.linear_int8: scales must be float16, got torch.float32"):
        op(x, qw, s.float(), 64)
    with pytest.raises(ValueError, match=r"qgemv.linear_int8: qweight.shape\[1\] must be round_up\(K, 16\) = 80, got 64"):
        op(torch.randn(3, 72, dtype=torch.float16, device=device), qw, s, 72)
    with pytest.raises(ValueError, match=r"qgemv.linear_int8: in_features must be a positive multiple of 8, got 60"):
        op(torch.randn(3, 60, dtype=torch.float16, device=device), qw, s, 60)
    with pytest.raises(ValueError, match=r"qgemv.linear_int8: qweight must be contiguous"):
        op(x, torch.cat([qw, qw], 1)[:, ::2], s, 64)
    with pytest.raises(ValueError, match=r"qgemv.linear_int8: scales must have shape \[8\], got \[4\]"):
        op(x, qw, s[:4], 64)


@pytest.mark.parametrize("device", DEVICES)
def test_errors_int4(device):
    x, qw, s, z = _int4g_args(device=device)
    op = qgemv.linear_int4_grouped
    with pytest.raises(ValueError, match=r"linear_int4_grouped: qweight must be int32, got torch.int64"):
        op(x, qw.long(), s, z, 32, 64)
    for bad in (16, 96, 0, -32):
        with pytest.raises(ValueError, match=rf"linear_int4_grouped: group_size must be 32, 64 or 128, got {bad}"):
            op(x, qw, s, z, bad, 64)
    with pytest.raises(ValueError, match=r"linear_int4_grouped: zeros must be uint8, got torch.int32"):
        op(x, qw, s, z.int(), 32, 64)
    with pytest.raises(ValueError, match=r"linear_int4_grouped: zeros must have shape \[8, 2\], got \[8, 1\]"):
        op(x, qw, s, z[:, :1].contiguous(), 32, 64)
    with pytest.raises(ValueError, match=r"linear_int4_grouped: scales must have shape \[8, 2\], got \[8, 1\]"):
        op(x, qw, s[:, :1].contiguous(), z, 32, 64)
    with pytest.raises(ValueError, match=r"linear_int4_grouped: qweight must be contiguous"):
        op(x, qw.t().contiguous().t(), s, z, 32, 64)
    with pytest.raises(ValueError, match=r"linear_int4_grouped: qweight.shape\[1\] must be round_up\(K, 32\) / 8 = 12"):
        op(torch.randn(3, 96, dtype=torch.float16, device=device), qw, s, z, 32, 96)
    qw4, s4, _ = (t if t is None else t.to(device) for t in formats.quantize_int4(torch.randn(8, 64)))
    with pytest.raises(ValueError, match=r"qgemv.linear_int4: scales must have shape \[8\], got \[8, 1\]"):
        qgemv.linear_int4(x, qw4, s4[:, None], 64)


@pytest.mark.parametrize("name", ["int8", "int4", "int4g64a"])
@pytest.mark.parametrize("width", [40, 48, 56, 72])
def test_x_width_other_than_the_packed_k_is_refused(name, width):
    """Issue 20: a weight packed for K = 64 pads its rows to 64 (int8: 16-k
    steps) or 64 (int4: 32-k steps) k, so the packed width cannot tell K = 56
    from 64.  The ops take K and refuse any x whose width differs, instead of
    computing x . W[:, :56]^T."""
    cfg = CFGS[name]
    qw, s, z = formats.quantize(torch.randn(8, 64), cfg)
    x = torch.randn(2, width)
    op, args = qgemv.ops.op_for(qgemv.PackedWeight(qw, s, z, cfg, 64))  # the public wrapper of that op
    with pytest.raises(ValueError, match=rf"x.shape\[-1\] must equal in_features \(64\), got {width}"):
        getattr(qgemv, op)(x, *args)


@pytest.mark.parametrize("bits,group", [(8, None), (4, None), (4, 128)])
def test_quantlinear_refuses_other_input_widths(bits, group):
    """QuantLinear(1024 -> 768, bits=4) used to accept x of width 1000 (the
    packed width of 1000 and 1024 is the same)."""
    q = qgemv.QuantLinear.from_linear(torch.nn.Linear(1024, 768, bias=False), bits, group)
    assert q(torch.randn(1, 1024)).shape == (1, 768)
    for width in (1000, 1016, 1008, 1032):
        with pytest.raises(ValueError, match=rf"x.shape\[-1\] must equal in_features \(1024\), got {width}"):
            q(torch.randn(1, width))


@pytest.mark.parametrize("device", DEVICES)
def test_errors_wrong_device(device):
    x, qw, s = _int8_args(device=device)
    with pytest.raises(ValueError, match=rf"qgemv.linear_int8: qweight must be on the same device as x \({device}\S*\), got meta"):
        qgemv.linear_int8(x, qw.to("meta"), s, 64)
    other = "cpu" if device != "cpu" else "meta"
    with pytest.raises(ValueError, match=rf"qgemv.linear_int8: scales must be on the same device as x \({device}\S*\), got {other}"):
        qgemv.linear_int8(x, qw, s.to(other), 64)


def test_errors_sgemv():
    A = torch.randn(5, 7)
    with pytest.raises(ValueError, match=r"qgemv.sgemv: x must have shape \[7\], got \[6\]"):
        qgemv.sgemv(A, torch.randn(6))
    with pytest.raises(ValueError, match=r"qgemv.sgemv: A must be float32, got torch.float16"):
        qgemv.sgemv(A.half(), torch.randn(7))
    with pytest.raises(ValueError, match=r"qgemv.sgemv: kernel must be one of"):
        qgemv.sgemv(A, torch.randn(7), kernel="k64")


SGEMV_SHAPES = [(1, 1), (7, 5), (33, 16), (65, 17), (129, 128), (4097, 130), (300, 4100), (28, 8192)]


def _sgemv_cases():
    """(N, K, kernel, device): the CPU's one sgemv (the reference), every CUDA kernel choice within its rule
    (k16: K <= 16; k128: K % 4 == 0); the others are refused (test_errors_sgemv)."""
    for n, k in SGEMV_SHAPES:
        yield pytest.param(n, k, "auto", "cpu", id=f"cpu-{n}x{k}")
        for kn in ("auto", "k32", "k128", "k16"):
            if not (kn == "k16" and k > 16 or kn == "k128" and k % 4):
                yield pytest.param(n, k, kn, "cuda", marks=requires_cuda, id=f"cuda-{kn}-{n}x{k}")


@pytest.mark.parametrize("n,k,kernel,device", list(_sgemv_cases()))
def test_sgemv(n, k, kernel, device):
    """fp32 y = A x within the fp32 summation bound, poisoned outputs on the GPU."""
    A = torch.randn(n, k, device=device)
    x = torch.randn(k, device=device)
    if device == "cuda":
        poison_like((n,), torch.float32)
    y = qgemv.sgemv(A, x, kernel=kernel)
    ref = A.double() @ x.double()
    bound = (k + 32) * 2.0**-24 * (A.double().abs() @ x.double().abs()) + 1e-6
    assert not torch.isnan(y).any()
    assert ((y.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [1, 24, 100], ids=["gemv", "tiled", "prefill"])
@pytest.mark.parametrize("name", ["int8", "int4", "int4g32a", "int4g128"])
def test_opcheck_linear(name, m, device):
    """torch.library.opcheck of each format's op: schema, fake kernel and the dispatch agree, with the
    CPU reference and with the CUDA kernels (whose token counts pick the GEMV, tiled and prefill paths)."""
    cfg = CFGS[name]
    k = 256
    qw, s, z = (t if t is None else t.to(device) for t in formats.quantize(torch.randn(72, k), cfg))
    x = torch.randn(m, k, device=device, dtype=torch.float16 if m != 24 else torch.bfloat16)
    op, args = qgemv.ops.op_for(qgemv.PackedWeight(qw, s, z, cfg, k))
    torch.library.opcheck(getattr(torch.ops.qgemv, op).default, (x, *args))


def _opcheck_cases():
    torch.manual_seed(1)
    x, qw, s, z = _int4g_args()
    yield "sgemv", torch.ops.qgemv.sgemv.default, (torch.randn(6, 20), torch.randn(20), 0)
    perm = torch.randperm(64, dtype=torch.int32)
    yield "int4g_asym_perm", torch.ops.qgemv.linear_int4_grouped.default, (x, qw, s, z, 32, 64, perm)
    xn = torch.randn(2, 3, 40, dtype=torch.float16)
    yield "add_rms_gather", torch.ops.qgemv.add_rms_gather.default, (
        xn, torch.randn_like(xn), torch.rand(40, dtype=torch.float16), torch.randperm(40, dtype=torch.int32), 1e-6)


@pytest.mark.parametrize("case", list(_opcheck_cases()), ids=lambda c: c[0])
def test_opcheck(case):
    _, op, args = case
    torch.library.opcheck(op, args)


def test_fake_shapes_on_meta():
    x = torch.empty(2, 3, 128, dtype=torch.bfloat16, device="meta")
    qw = torch.empty(40, 16, dtype=torch.int32, device="meta")
    s = torch.empty(40, 2, dtype=torch.float16, device="meta")
    y = torch.ops.qgemv.linear_int4_grouped(x, qw, s, None, 64, 128)
    assert y.shape == (2, 3, 40) and y.dtype == torch.bfloat16 and y.device.type == "meta"


def test_set_gemv_pdl_validates_mode():
    """The PDL knob takes the documented modes and names the rule otherwise
    (on every backend; the CUDA tests check what the launch then does)."""
    try:
        for mode in qgemv._ext.GEMV_PDL_MODES:
            qgemv.set_gemv_pdl(mode)
        for bad in (2, 4, 6, 8, -2, True, 7.0, "7"):
            with pytest.raises(ValueError, match="set_gemv_pdl: mode must be one of"):
                qgemv.set_gemv_pdl(bad)
    finally:
        qgemv.set_gemv_pdl(-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CFGS))
def test_perm_multiplies_the_gathered_input(name, device):
    """perm (act-order): every op computes x[..., perm] @ W^T, the same numbers as gathering first."""
    cfg = CFGS[name]
    torch.manual_seed(3)
    k = 256
    qw, s, z = (t if t is None else t.to(device) for t in formats.quantize(torch.randn(24, k), cfg))
    x = torch.randn(2, 3, k, dtype=torch.bfloat16, device=device)
    perm = torch.randperm(k, dtype=torch.int32, device=device)
    op, args = qgemv.ops.op_for(qgemv.PackedWeight(qw, s, z, cfg, k))
    y, want = getattr(qgemv, op)(x, *args, perm), getattr(qgemv, op)(x[..., perm.long()], *args)
    assert torch.equal(y, want)
    assert not torch.equal(y, _call(cfg, x, qw, s, z))


@pytest.mark.parametrize("bad,rule", [
    (lambda p: p.long(), "perm must be int32"),
    (lambda p: p[:-8], r"perm must have shape \[64\]"),
    (lambda p: torch.stack([p, p], 1)[:, 0], "perm must be contiguous"),
    (lambda p: torch.zeros_like(p), "perm must be a permutation of 0..63"),
    (lambda p: p + 1, "perm must be a permutation of 0..63"),
])
def test_bad_perm_is_refused_naming_the_rule(bad, rule):
    qw, s, z = formats.quantize(torch.randn(8, 64), formats.QuantConfig(4, 32, False))
    perm = bad(torch.randperm(64, dtype=torch.int32))
    with pytest.raises(ValueError, match=rule):
        qgemv.linear_int4_grouped(torch.randn(1, 64), qw, s, z, 32, 64, perm)
    with pytest.raises(ValueError, match=rule):  # the op itself (the reference on the CPU)
        torch.ops.qgemv.linear_int4_grouped(torch.randn(1, 64), qw, s, z, 32, 64, perm)


@pytest.mark.skipif(qgemv._ext.MODULE is None, reason="needs the compiled extension (its rule is C++)")
def test_gemv_gather_rule_as_documented():
    """Where the GEMV gathers an act-order input itself (csrc/qgemv.h, gemv_gathers; README and ops.py
    quote it): up to 8 tokens, 4 (M + 1) K bytes of shared memory within 32 KB, at most 512 16-row panels;
    and the testing knob turns it off."""
    t = qgemv._ext.MODULE.testing
    assert t.gemv_gathers(1, 4096, 4096) and t.gemv_gathers(1, 8192, 4096) and t.gemv_gathers(3, 4096, 2048)
    assert not t.gemv_gathers(2, 4096, 4096)  # 48 KB
    assert not t.gemv_gathers(1, 8208, 4096)  # 513 panels
    assert not t.gemv_gathers(1, 4096, 8192)  # 64 KB
    assert not t.gemv_gathers(9, 64, 64) and not t.gemv_gathers(0, 64, 64)
    t.set_gemv_gather(False)
    try:
        assert not t.gemv_gathers(1, 4096, 4096)
    finally:
        t.set_gemv_gather(True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (3, 37), (2, 1, 576)])
def test_add_rms_gather_is_the_norm_then_the_gather(dtype, shape):
    """The reference equals the generation engine's eager glue (add, transformers' RMSNorm, index_select)
    bit for bit, and the kernel's arithmetic (one rounding after the gain) gives the same bits."""
    from qgemv.engine import glue_add_rms_gather

    g = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(shape, generator=g).to(dtype)
    d = torch.randn(shape, generator=g).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    perm = torch.randperm(shape[-1], generator=g).to(torch.int32)
    s, y = qgemv.ops.add_rms_gather(x, d, w, perm, 1e-5)
    want_s, want_y = glue_add_rms_gather(x, d, w, perm.long(), 1e-5)
    assert s.dtype == y.dtype == dtype and s.shape == y.shape == x.shape
    assert torch.equal(s, want_s) and torch.equal(y, want_y)
    sf = s.float()
    n = (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    plain = (w.float() * n.float()).to(dtype)  # the CUDA kernel's arithmetic: one rounding after the gain
    assert torch.equal(y, plain[..., perm.long()])
    assert not torch.equal(y, w * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)) \
        or shape[-1] == 1  # the gather moved something


@pytest.mark.parametrize("change,rule", [
    (dict(x=lambda t: t.long()), "x must be float16, bfloat16 or float32, got torch.int64"),
    (dict(x=lambda t: t[..., :0], delta=lambda t: t[..., :0], w=lambda t: t[:0], perm=lambda t: t[:0]),
     r"x.shape\[-1\] must be in 1..16384, got 0"),
    (dict(delta=lambda t: t[:1]), r"delta must have x's shape \[2, 24\], got \[1, 24\]"),
    (dict(delta=lambda t: t.float()), "delta must have x's dtype torch.float16, got torch.float32"),
    (dict(w=lambda t: t[:-1]), r"weight must have shape \[24\], got \[23\]"),
    (dict(w=lambda t: t.float()), "weight must have x's dtype torch.float16, got torch.float32"),
    (dict(perm=lambda t: t.long()), "perm must be int32, got torch.int64"),
    (dict(perm=lambda t: t[:-1]), r"perm must have shape \[24\]"),
    (dict(perm=lambda t: torch.zeros_like(t)), "perm must be a permutation of 0..23"),
    (dict(eps=lambda e: -1.0), "eps must be a finite number >= 0, got -1.0"),
    (dict(eps=lambda e: float("nan")), "eps must be a finite number >= 0, got nan"),
    (dict(w=lambda t: t.to("meta")), "weight must be on the same device as x"),
])
def test_add_rms_gather_refuses_bad_input_naming_the_rule(change, rule):
    args = dict(x=torch.randn(2, 24, dtype=torch.float16), delta=torch.randn(2, 24, dtype=torch.float16),
                w=torch.rand(24, dtype=torch.float16), perm=torch.randperm(24, dtype=torch.int32), eps=1e-6)
    args = {k: change.get(k, lambda v: v)(v) for k, v in args.items()}
    call = (args["x"], args["delta"], args["w"], args["perm"], args["eps"])
    with pytest.raises(ValueError, match="qgemv.add_rms_gather: " + rule):
        qgemv.ops.add_rms_gather(*call)
    with pytest.raises(ValueError, match="qgemv.add_rms_gather: " + rule):  # the op (the CPU reference)
        torch.ops.qgemv.add_rms_gather(*call)
