"""CUDA kernels vs the fp64 reference on the same quantized weights: paths,
shapes and tight bounds (the contract every device shares, errors and opcheck
included, is in test_ops.py, parametrized over format x device).

Skipped per test without a GPU; run on the lent H200 (see BENCHMARKS.md).

Tolerances (tight, same quantized weights):
* GEMV path (M <= 16; 17..256 tokens in 16-token chunks when forced), and
  the tiled GEMMs with per-channel scales: the products (q - z) * x are exact in the MMA and the
  sums are fp32, so |y - ref| <= n * 2^-24 * (|x| @ |W|^T) with n, the number
  of sequential fp32 additions, bounded by K/8 + 32; plus half an ulp of the
  output dtype (2^-11 relative for fp16, 2^-8 for bf16).
* Dequantize + GEMM path, and the tiled GEMMs (mma.sync and wgmma) with
  group-wise scales: the weight (q - z) * s is rounded once to the
  activation dtype, which adds at most eps_T * (|x| @ |W|^T) with eps_T the
  same half-ulp.
A normwise check ||y - ref|| / ||ref|| < 4 * eps_T guards against errors that
hide under the elementwise bound at large K.
"""

import functools

import pytest
import torch

import qgemv
from qgemv import formats

from conftest import FORMATS, poison_like, quantized_linear, requires_cuda

EPS = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
CFGS = FORMATS
LLAMA = [(4096, 4096), (12288, 4096), (11008, 4096), (4096, 11008), (14336, 4096),
         (4096, 14336), (8192, 8192), (28672, 8192), (8192, 28672)]
ODD_K = [8, 24, 136, 2880, 5128]
ODD_N = [1, 7, 4097]
MS = [1, 2, 3, 5, 8, 13, 16, 17, 64]


def _fits(cfg, k):
    return cfg.group_size is None or k % cfg.group_size == 0


_call = quantized_linear


def _quantized(cfg, n, k):
    # Quantize on the GPU (pure torch) to keep the tests fast.
    w = torch.randn(n, k, device="cuda") * 0.02
    return formats.quantize(w, cfg)


def _check(cfg, x, qw, s, z, k, dense=None):
    n = qw.shape[0]
    m = x.numel() // k
    poison_like((*x.shape[:-1], n), x.dtype)
    y = _call(cfg, x, qw, s, z)
    torch.cuda.synchronize()
    assert y.shape == (*x.shape[:-1], n) and y.dtype == x.dtype
    assert not torch.isnan(y).any(), "unwritten (NaN-poisoned) outputs"
    wd = formats.dequantize(qw, s, z, cfg, k).double()
    xd = x.double().reshape(-1, k)
    ref = xd @ wd.t()
    mag = xd.abs() @ wd.abs().t()
    eps = EPS[x.dtype]
    acc = (k / 8 + 32) * 2.0**-24
    if dense is None:  # whether the path the op takes rounds the weight first
        from qgemv import _C

        path = _C.testing.prefill_path(n, k, m)
        dense = path == _C.testing.PREFILL_DENSE or (path in (_C.testing.PREFILL_TILED, _C.testing.PREFILL_WGMMA) and cfg.bits == 4
                                              and cfg.group_size is not None)
    bound = (acc + eps if dense else acc) * mag + eps * ref.abs() + 1e-6
    err = (y.double().reshape(-1, n) - ref).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {worst:.2f}x the bound"
    if ref.norm() > 0:
        assert (err.norm() / ref.norm()).item() < 4 * eps


def _fitting(names, ks):
    """(format, K) pairs whose group size divides K: impossible pairs are never generated."""
    return [(name, k) for name in names for k in ks if _fits(CFGS[name], k)]


@functools.lru_cache(maxsize=16)
def _weights(name, n, k):
    """One quantized weight per (format, N, K), shared by the token counts that test it."""
    return _quantized(CFGS[name], n, k)


def _check_m(name, n, k, m, dtype):
    cfg = CFGS[name]
    qw, s, z = _weights(name, n, k)
    _check(cfg, torch.randn(m, k, device="cuda", dtype=dtype), qw, s, z, k)


@requires_cuda
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n", ODD_N)
@pytest.mark.parametrize("name,k", _fitting(CFGS, ODD_K), ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_odd_shapes(dtype, name, k, n, m):
    _check_m(name, n, k, m, dtype)


@requires_cuda
@pytest.mark.slow
@pytest.mark.parametrize("m,dtype", [(1, torch.float16), (1, torch.bfloat16), (4, torch.float16),
                                     (16, torch.bfloat16), (64, torch.float16)], ids=str)
@pytest.mark.parametrize("name", list(CFGS))
@pytest.mark.parametrize("n,k", LLAMA, ids=[f"{n}x{k}" for n, k in LLAMA])
def test_llama_shapes(n, k, name, m, dtype):
    _check_m(name, n, k, m, dtype)


@requires_cuda
@pytest.mark.parametrize("m", [9, 13, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name,k", _fitting(["int4", "int4g128", "int4g128a"], [136, 1152, 2880]), ids=str)
def test_two_row_tile_kernel_odd_shapes(k, name, dtype, m):
    """9..16 tokens on N >= 8192 take the two-row-tile instance (the kRT = 2 rows of
    csrc/instances.h): N = 8197 ends in a 5-row panel, and its last block's
    second row tile lies wholly past N."""
    _check_m(name, 8197, k, m, dtype)


@requires_cuda
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name,k", _fitting(["int8", "int4", "int4g128"], [136, 1152, 2880]), ids=str)
def test_persistent_kernel_odd_shapes(k, name, dtype, m):
    """1..8 tokens on a grid of more than one wave take the persistent instance
    (the persistent rows of csrc/instances.h) for int8 and int4 per channel /
    G = 128: N = 50005 gives 3126 blocks of 16 rows, more than any H200
    residency, so each block walks several, ending in a 5-row panel; K = 136
    and 2880 leave an edge tile (per channel; G = 128 takes K = 1152)."""
    _check_m(name, 50005, k, m, dtype)


class _ForcedPath:
    """Force the dispatch's path for M > 16 (csrc/torch_bindings.cpp) inside a with block."""

    def __init__(self, path):
        from qgemv import _C

        self.C, self.path = _C, path

    def __enter__(self):
        self.old = self.C.testing.get_prefill_path()
        self.C.testing.set_prefill_path(self.path)

    def __exit__(self, *exc):
        self.C.testing.set_prefill_path(self.old)


PREFILL_PATHS = ["chunks", "dense", "tiled", "wgmma"]


def _path_number(path):
    """A prefill path's number in qgemv._C.testing; skips wgmma where it cannot run."""
    from qgemv import _C

    if path == "wgmma" and not _C.wgmma_available():
        pytest.skip("the wgmma GEMM needs compute capability 9.0 and an sm_90a build")
    return {"chunks": _C.testing.PREFILL_CHUNKS, "dense": _C.testing.PREFILL_DENSE,
            "tiled": _C.testing.PREFILL_TILED, "wgmma": _C.testing.PREFILL_WGMMA}[path]


@requires_cuda
@pytest.mark.parametrize("m,dtype", [(17, torch.float16), (33, torch.bfloat16), (64, torch.float16),
                                     (100, torch.bfloat16)], ids=str)
@pytest.mark.parametrize("path", PREFILL_PATHS)
@pytest.mark.parametrize("name", ["int8", "int4", "int4g64a", "int4g128"])
def test_prefill_all_paths(name, path, m, dtype):
    """M > 16 through each path the dispatch chooses between, whatever M:
    16-token GEMV chunks (a partial last chunk), the tiled mma.sync GEMM,
    dequantize + cuBLAS, and (on cc 9.0) the wgmma GEMM."""
    with _ForcedPath(_path_number(path)):
        _check_m(name, 1000, 640, m, dtype)


@requires_cuda
@pytest.mark.parametrize("m", [17, 64, 65, 129])
@pytest.mark.parametrize("n", [1, 7, 130, 4097])
@pytest.mark.parametrize("name,k", _fitting(CFGS, ODD_K + [4096]), ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kind", ["tiled", "wgmma"])
def test_tiled_gemm_odd_shapes(kind, dtype, name, k, n, m):
    """The tiled GEMMs (csrc/gemm_mma.cu, csrc/gemm_wgmma.cu) on odd shapes:
    N = 1, 7 (one partial panel), 130 (a block of 128 rows plus a 2-row
    panel), 4097; K with an edge tile (8, 24, 136, 2880, 5128) or without
    (4096); M across the 32-, 64- and 128-token block boundaries (17, 64, 65,
    129)."""
    with _ForcedPath(_path_number(kind)):
        _check_m(name, n, k, m, dtype)


@requires_cuda
@pytest.mark.parametrize("shape", [0, 1])
@pytest.mark.parametrize("name", ["int8", "int4", "int4g32a", "int4g128"])
def test_wgmma_block_shapes(name, shape):
    """Each block shape of the wgmma GEMM forced (64 tokens x 256 rows; 128 x
    128, warp-specialized), fp16 and bf16, with partial blocks in every
    direction: N = 300 (a partial row block and a 12-row panel), K with an
    edge tile (2904 for int8 and int4, 2880 for G = 32; G = 128 has none:
    2944), M = 130 (a partial token block)."""
    from qgemv import _C

    path = _path_number("wgmma")
    cfg = CFGS[name]
    n, k = 300, {"int4g32a": 2880, "int4g128": 2944}.get(name, 2904)
    qw, s, z = _quantized(cfg, n, k)
    _C.testing.set_wgmma_shape(shape)
    try:
        with _ForcedPath(path):
            for m, dtype in [(130, torch.float16), (40, torch.bfloat16)]:
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                _check(cfg, x, qw, s, z, k)
    finally:
        _C.testing.set_wgmma_shape(-1)
    with pytest.raises(ValueError, match="set_wgmma_shape"):
        _C.testing.set_wgmma_shape(_C.testing.wgmma_shape_count())


@requires_cuda
@pytest.mark.parametrize("kind", ["tiled", "wgmma"])
def test_tiled_gemm_scale_range(kind):
    """The tiled GEMMs with group scales spanning 1e-4 .. 1 across rows and
    activations of magnitude ~30: the weights (q - z) * s, rounded to the
    activation dtype before the MMA, stay within the bound in every row."""
    cfg = CFGS["int4g128a"]
    n, k = 300, 1024
    w = torch.randn(n, k, device="cuda") * torch.logspace(-3, 0, n, device="cuda")[:, None]
    qw, s, z = formats.quantize(w, cfg)
    with _ForcedPath(_path_number(kind)):
        for dtype in (torch.float16, torch.bfloat16):
            x = torch.randn(40, k, device="cuda", dtype=dtype) * 30
            _check(cfg, x, qw, s, z, k)


@requires_cuda
@pytest.mark.parametrize("kind", ["tiled", "wgmma"])
@pytest.mark.parametrize("name", ["int8", "int4g128a"])
def test_tiled_gemm_split_k_deterministic(name, kind):
    """A small grid splits K (splits_for in csrc/gemm_mma.cu, Instance::plan
    in csrc/gemm_wgmma.cu): 256 x 8192 at M = 40 is 1 or 2 blocks, so K is
    cut into 8 parts whose fp32 partial sums are added in a fixed order; two
    calls give bitwise-equal outputs."""
    cfg = CFGS[name]
    n, k = 256, 8192
    qw, s, z = _quantized(cfg, n, k)
    x = torch.randn(40, k, device="cuda", dtype=torch.float16)
    with _ForcedPath(_path_number(kind)):
        _check(cfg, x, qw, s, z, k)
        a = _call(cfg, x, qw, s, z)
        b = _call(cfg, x, qw, s, z)
    assert torch.equal(a, b)


@requires_cuda
def test_prefill_dispatch_rule():
    """The measured rule (csrc/torch_bindings.cpp): one GEMV launch up to 16
    tokens.  On cc 9.0 with the sm_90a build: the tiled mma.sync GEMM up to
    wgmma_min_tokens - 1 (wgmma_min_tokens_small - 1 for weights of at most
    small_weight elements), the wgmma GEMM up to wgmma_max_tokens, then
    dequantize + cuBLAS.  Elsewhere the tiled GEMM up to tiled_max_tokens,
    then dequantize + cuBLAS.  A forced path applies and -1 restores the
    rule; bad values are refused."""
    from qgemv import _C

    assert _C.testing.get_prefill_path() == -1
    for n, k in [(4096, 4096), (28672, 8192)]:
        assert _C.testing.prefill_path(n, k, 16) == -1
        assert _C.testing.prefill_path(n, k, 17) == _C.testing.PREFILL_TILED
        if _C.wgmma_available():
            small = n * k <= _C.testing.small_weight
            last_tiled = (_C.testing.wgmma_min_tokens_small if small else _C.testing.wgmma_min_tokens) - 1
            assert _C.testing.prefill_path(n, k, last_tiled) == _C.testing.PREFILL_TILED
            assert _C.testing.prefill_path(n, k, last_tiled + 1) == _C.testing.PREFILL_WGMMA
            assert _C.testing.prefill_path(n, k, _C.testing.wgmma_max_tokens) == _C.testing.PREFILL_WGMMA
            assert _C.testing.prefill_path(n, k, _C.testing.wgmma_max_tokens + 1) == _C.testing.PREFILL_DENSE
        else:
            assert _C.testing.prefill_path(n, k, _C.testing.tiled_max_tokens) == _C.testing.PREFILL_TILED
            assert _C.testing.prefill_path(n, k, _C.testing.tiled_max_tokens + 1) == _C.testing.PREFILL_DENSE
    with _ForcedPath(_C.testing.PREFILL_CHUNKS):
        assert _C.testing.prefill_path(4096, 4096, 2048) == _C.testing.PREFILL_CHUNKS
    assert _C.testing.get_prefill_path() == -1
    with pytest.raises(ValueError, match="set_prefill_path"):
        _C.testing.set_prefill_path(4)


@requires_cuda
@pytest.mark.parametrize("name", ["int8", "int4", "int4g128a"])
def test_fp32_activations_on_cuda(name):
    cfg = CFGS[name]
    k, n = 512, 96
    qw, s, z = _quantized(cfg, n, k)
    x = torch.randn(3, k, device="cuda")
    y = _call(cfg, x, qw, s, z)
    ref = x.double() @ formats.dequantize(qw, s, z, cfg, k).double().t()
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-4)


@requires_cuda
@pytest.mark.parametrize("name", ["int8", "int4g128", "int4g32a"])
@pytest.mark.parametrize("m", [1, 24, 40], ids=["gemv", "tiled_split_k", "gemm_split_k"])
def test_cuda_graph_replay(name, m):
    """Capture then replay equals a direct call: M = 1 (GEMV), M = 24 (the
    tiled GEMM) and M = 40 (the wgmma GEMM on cc 9.0, else the tiled one);
    at 4096 x 4096 both split K and allocate their workspaces (fp32 partials,
    permuted activations) inside the capture."""
    cfg = CFGS[name]
    k, n = 4096, 4096
    qw, s, z = _quantized(cfg, n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            _call(cfg, x, qw, s, z)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = _call(cfg, x, qw, s, z)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, _call(cfg, x, qw, s, z))


class _GemvPdl:
    """Context: the GEMV launch mode of qgemv._C.set_gemv_pdl, restored after."""

    def __init__(self, mode):
        from qgemv import _C

        self.C, self.mode = _C, mode

    def __enter__(self):
        self.C.set_gemv_pdl(self.mode)
        if self.mode > 0 and not self.C.gemv_pdl_flags():
            self.C.set_gemv_pdl(-1)
            pytest.skip("programmatic dependent launch needs compute capability 9.0 and an sm_90 build")
        return self

    def __exit__(self, *exc):
        self.C.set_gemv_pdl(-1)


def _pdl_chain(cfg, qws, x0, xbuf, wbuf, steps):
    """Each GEMV's x and weight are written by the two kernels just before it
    (elementwise kernels, not copies: xbuf <- last output x 0.5, wbuf <- the
    step's weight; on odd steps the weight is written last); returns every
    step's output."""
    outs = []
    y = x0
    for i in range(steps):
        qw, s, z = qws[i % len(qws)]
        if i % 2:
            torch.mul(y, 0.5, out=xbuf)
            torch.bitwise_or(qw, 0, out=wbuf)
        else:
            torch.bitwise_or(qw, 0, out=wbuf)
            torch.mul(y, 0.5, out=xbuf)
        y = _call(cfg, xbuf, wbuf, s, z)
        outs.append(y)
    return outs


@requires_cuda
@pytest.mark.parametrize("name", ["int8", "int4", "int4g128a"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("mode", [1, 7])
def test_gemv_pdl_reads_what_the_kernel_before_wrote(name, graph, mode):
    """With the programmatic launch, the GEMV may start while the kernel
    before it runs. Here that kernel writes its x or its weight (a square
    chain: each output, halved, is the next input; the weight buffer is
    refilled before every call). The chain must equal the same chain with
    ordinary launches, bit for bit, eager and under CUDA-graph replay."""
    cfg = CFGS[name]
    k = n = 2944  # 23 x 128: odd panel count, an edge tile for int4 (K % 128 == 0 but not % 256)
    qws = [_quantized(cfg, n, k) for _ in range(3)]
    x0 = torch.randn(4, k, device="cuda", dtype=torch.float16)
    xbuf = torch.empty_like(x0)
    wbuf = torch.empty_like(qws[0][0])
    with _GemvPdl(0):
        ref = [y.clone() for y in _pdl_chain(cfg, qws, x0, xbuf, wbuf, 9)]
    with _GemvPdl(mode):
        if not graph:
            got = _pdl_chain(cfg, qws, x0, xbuf, wbuf, 9)
        else:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                _pdl_chain(cfg, qws, x0, xbuf, wbuf, 2)
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                got = _pdl_chain(cfg, qws, x0, xbuf, wbuf, 9)
            for y in got:
                y.fill_(float("nan"))
            g.replay()
        torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a, b), f"step {i}: the programmatic launch changed the result"


@requires_cuda
def test_gemv_pdl_knob_rejects_bad_mode():
    from qgemv import _C

    with pytest.raises(ValueError, match="set_gemv_pdl"):
        _C.set_gemv_pdl(2)
    with pytest.raises(ValueError, match="set_gemv_pdl"):
        _C.set_gemv_pdl(2)  # a prefetch without the programmatic launch
    with _GemvPdl(0):
        assert _C.gemv_pdl_flags() == 0
    if torch.cuda.get_device_capability()[0] < 9:
        assert _C.gemv_pdl_flags() == 0
    else:
        with _GemvPdl(5):
            assert _C.gemv_pdl_flags() == 5


@requires_cuda
def test_runs_on_current_stream_and_device_guard():
    cfg = CFGS["int4g128"]
    qw, s, z = _quantized(cfg, 512, 512)
    x = torch.randn(2, 512, device="cuda", dtype=torch.float16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # x and the weights are written on the default stream
    with torch.cuda.stream(side):
        y = _call(cfg, x, qw, s, z)
    side.synchronize()
    _check(cfg, x, qw, s, z, 512)
    assert torch.equal(y, _call(cfg, x, qw, s, z))


@requires_cuda
@pytest.mark.parametrize("bits,group,sym", [(8, None, True), (4, 128, True), (4, 32, False)])
def test_torch_compile_fullgraph(bits, group, sym):
    lin = torch.nn.Linear(256, 128, bias=True).cuda().half()
    q = qgemv.QuantLinear.from_linear(lin, bits, group, sym)
    f = torch.compile(q, fullgraph=True)
    for m in (4, 24, 40):  # GEMV, tiled GEMM, wgmma GEMM (cc 9.0)
        x = torch.randn(m, 256, device="cuda", dtype=torch.float16)
        torch.testing.assert_close(f(x), q(x))


def _perm_case(name, n, k, m, dtype, seed=0):
    cfg = CFGS[name]
    qw, s, z = _weights(name, n, k)
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
    perm = torch.randperm(k, device="cuda", dtype=torch.int32, generator=g)
    poison_like((m, n), dtype)
    y = qgemv.ops.linear(x, qgemv.PackedWeight(qw, s, z, cfg, k), perm)
    torch.cuda.synchronize()
    assert not torch.isnan(y).any(), "unwritten (NaN-poisoned) outputs"
    # The same kernels on the input gathered first: the in-kernel gather changes where x is read, not the
    # arithmetic, so the results agree bit for bit; and that path is itself checked against the reference.
    want = _call(cfg, x[:, perm.long()], qw, s, z)
    assert torch.equal(y, want)
    _check(cfg, x[:, perm.long()].contiguous(), qw, s, z, k)


@requires_cuda
@pytest.mark.parametrize("m", [1, 2, 5, 8, 13])
@pytest.mark.parametrize("n", [7, 4097])
@pytest.mark.parametrize("name,k", _fitting(CFGS, [24, 136, 2880, 5128]), ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_act_order_perm_gathered_in_the_gemv(dtype, name, k, n, m):
    """perm (act-order) for 1..8 tokens is gathered inside the GEMV while its shared memory, 4 (M + 1) K
    bytes, fits in 32 KB, on up to 512 panels (qgemv.h, gemv_gathers: K = 24 and 136 up to 8 tokens,
    K = 2880 at 1; K = 5128 and 13 tokens take the gather-first path): odd K with an edge tile, a 7-row
    panel, every format."""
    _perm_case(name, n, k, m, dtype)


@requires_cuda
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("name,k", _fitting(["int8", "int4", "int4g128"], [136, 1152]), ids=str)
def test_act_order_perm_on_many_panels(name, k, m):
    """N = 50005 (the persistent grid's shapes, 3126 panels) gathers x first (gemv_gathers: at most 512
    panels), then runs the plain kernels."""
    _perm_case(name, 50005, k, m, torch.float16)


@requires_cuda
@pytest.mark.parametrize("m", [1, 100])
def test_act_order_perm_bad_values_never_read_outside_x(m):
    """The CUDA op does not read perm back (that would synchronize): an index past K is clamped inside the
    GEMV (wrong numbers, no fault), and the process's CUDA context stays usable."""
    qw, s, z = _weights("int4g128a", 64, 256)
    x = torch.randn(m, 256, device="cuda", dtype=torch.float16)
    perm = torch.randperm(256, device="cuda", dtype=torch.int32)
    if m == 1:
        perm[3] = 1 << 30
        perm[5] = -7
        y = torch.ops.qgemv.linear_int4_grouped(x, qw, s, z, 128, 256, perm)
        torch.cuda.synchronize()
        assert y.shape == (1, 64)
    with pytest.raises(ValueError, match="perm must be a permutation"):
        qgemv.linear_int4_grouped(x, qw, s, z, 128, 256, torch.zeros_like(perm))
    assert torch.isfinite(_call(CFGS["int4g128a"], x, qw, s, z)).all()


@requires_cuda
def test_act_order_perm_under_cuda_graph_and_opcheck():
    """The in-kernel gather under graph replay reads the perm and x of replay time; opcheck with perm."""
    qw, s, z = _weights("int4g128a", 300, 1024)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.float16)
    perm = torch.randperm(1024, device="cuda", dtype=torch.int32)
    op = torch.ops.qgemv.linear_int4_grouped
    op(x, qw, s, z, 128, 1024, perm)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = op(x, qw, s, z, 128, 1024, perm)
    x.copy_(torch.randn_like(x))
    perm.copy_(torch.randperm(1024, device="cuda", dtype=torch.int32))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, op(x[:, perm.long()], qw, s, z, 128, 1024))
    torch.library.opcheck(op.default, (x, qw, s, z, 128, 1024, perm))


NORM_SHAPES = [(1, 1), (3, 7), (2, 1, 33), (1, 576), (1, 4096), (5, 5120), (16, 1, 8200), (2, 12300), (1, 16384)]


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda v: "x".join(map(str, v)))
def test_add_rms_gather_kernel_matches_the_reference(shape, dtype):
    """The one-kernel residual add + RMSNorm + act-order gather against the CPU reference on fresh data:
    the sum exactly, the normalized row within one rounding of the output per rounding step (the fp32 sum
    of squares is taken in another order), poisoned outputs.  12300 and 16384 take over 48 KB of shared
    memory; 12300 and the widths that are not a multiple of 8 run the scalar path."""
    x = torch.randn(shape, device="cuda").to(dtype)
    d = torch.randn(shape, device="cuda").to(dtype)
    w = (torch.rand(shape[-1], device="cuda") + 0.5).to(dtype)
    perm = torch.randperm(shape[-1], device="cuda", dtype=torch.int32)
    poison_like(shape, dtype)
    poison_like(shape, dtype)
    s, y = qgemv.ops.add_rms_gather(x, d, w, perm, 1e-5)
    torch.cuda.synchronize()
    want_s, want_y = qgemv.ops.ref_add_rms_gather(x.cpu(), d.cpu(), w.cpu(), perm.cpu(), 1e-5)
    assert not torch.isnan(s).any() and not torch.isnan(y).any(), "unwritten (NaN-poisoned) outputs"
    assert torch.equal(s.cpu(), want_s)
    # n = s * r rounded (r within a few fp32 ulps of the reference's, whose sum runs in another order),
    # then times w rounded: one ulp apart at most per rounding; fp32 keeps the sum's and rsqrtf's error
    ulp = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 4e-6}[dtype]
    bound = 2.5 * ulp * want_y.float().abs() + 1e-6
    err = (y.cpu().float() - want_y.float()).abs()
    assert (err <= bound).all(), f"max error {err.max().item():.3g}"


@requires_cuda
def test_add_rms_gather_under_cuda_graph_opcheck_and_bad_perm():
    """Graph replay reads the x, delta and perm of replay time; opcheck; a misaligned perm (the scalar
    path) gives the same row; a perm out of range is clamped (wrong values, no read outside the row, no
    error)."""
    op = torch.ops.qgemv.add_rms_gather
    x = torch.randn(2, 1, 4096, device="cuda", dtype=torch.float16)
    d, w = torch.randn_like(x), torch.rand(4096, device="cuda", dtype=torch.float16)
    perm = torch.randperm(4096, device="cuda", dtype=torch.int32)
    op(x, d, w, perm, 1e-6)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        s, y = op(x, d, w, perm, 1e-6)
    x.copy_(torch.randn_like(x))
    perm.copy_(torch.randperm(4096, device="cuda", dtype=torch.int32))
    g.replay()
    torch.cuda.synchronize()
    want = op(x, d, w, perm, 1e-6)
    assert torch.equal(s, want[0]) and torch.equal(y, want[1])
    torch.library.opcheck(op.default, (x, d, w, perm, 1e-6))
    shifted = torch.empty(4097, device="cuda", dtype=torch.int32)[1:]  # not 16-byte aligned: the scalar path
    shifted.copy_(perm)
    torch.testing.assert_close(op(x, d, w, shifted, 1e-6)[1], want[1], rtol=2.0**-9, atol=1e-3)
    bad = perm.clone()
    bad[:8] = torch.tensor([-1, 4096, 1 << 30, -(1 << 30), 5000, 4095, 0, 7], dtype=torch.int32)
    _, y = op(x, d, w, bad, 1e-6)
    torch.cuda.synchronize()
    assert torch.isfinite(y).all()
    with pytest.raises(ValueError, match="perm must be a permutation of 0..4095"):
        qgemv.ops.add_rms_gather(x, d, w, bad, 1e-6)


def test_extension_ops_registered_when_buildable():
    # Holds in CI too (no GPU): with nvcc and a CUDA torch, .ci/run builds
    # csrc/ and the CUDA key of every op must come from the extension.
    import shutil

    from qgemv import _ext

    if not (shutil.which("nvcc") and torch.version.cuda):
        pytest.skip("no nvcc or a CPU-only torch: the extension cannot be built here")
    import importlib.util
    import os

    if importlib.util.find_spec("qgemv._C") is None and os.environ.get("QGEMV_JIT") != "1":
        # a pure-Python install (pip install ".[hf]" builds without torch); .ci/install.sh fails on a failed build
        pytest.skip("this qgemv was installed without its CUDA extension (no qgemv._C, QGEMV_JIT unset)")
    assert _ext.BACKEND in ("aot", "jit"), _ext.REASON
    for name in ("linear_int8", "linear_int4", "linear_int4_grouped", "sgemv", "add_rms_gather"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"qgemv::{name}", "CUDA"), name


@requires_cuda
@pytest.mark.parametrize("bits,group", [(8, None), (4, 32), (4, None)])
def test_generation_cpu_reference_equals_gpu_kernels(bits, group):
    """Greedy tokens from the CPU reference path equal those from the CUDA kernels (same quantized weights)."""
    import copy

    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # peaked logits: argmax margins far above fp16 noise
    model = model.half()
    qgemv.nn.fuse_llama_projections(model, bits, group)
    qgemv.quantize_model(model, bits=bits, group_size=group)
    gpu = copy.deepcopy(model).cuda()
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (2, 6))  # with these seeds every greedy step has a top-2 margin >= 0.06 (CPU)
    with torch.no_grad():
        cpu_tokens = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
        gpu_tokens = gpu.generate(ids.cuda(), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(cpu_tokens, gpu_tokens.cpu())


@requires_cuda
@pytest.mark.parametrize("m", [1, 5, 16, 40, 300])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int8_code_minus_128_every_path(m, dtype):
    """Format version 4 stores int8 codes in [-128, 127] (compressed-tensors' symmetric int8): every path
    (GEMV, chunked GEMV, tiled / wgmma GEMM, dequantize + GEMM) decodes -128 exactly."""
    n, k = 4096, 4096 + 136  # a k tail past the last full tile
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, device="cuda")
    q[:, :64] = -128  # whole tiles of the extreme code
    qw = formats.pack_int8(q)
    s = (torch.rand(n, device="cuda") * 1e-3 + 1e-4).half()
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    _check(CFGS["int8"], x, qw, s, None, k)
