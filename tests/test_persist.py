"""The persistent chain (qgemv.persist, csrc/persist.cu).

On the CPU (the extension built, no GPU needed): the host side the kernel
trusts, re-derived independently here: every tile of every linear assigned to
exactly one warp of one block, in order; the fused G = 128 tiles' bytes; the
plan's refusals.  On a compute-capability-9 GPU: the chain against the per-op
chain (qgemv.persist.reference) for every supported format, odd grids, with
and without the layers' RMSNorms, CUDA graph replays, and a grid too large to
be co-resident refused, not hung; the final norm, lm_head and argmax inside
the launch (Head) against the per-op end on the launch's own output.
"""

import math
import subprocess
import sys
import textwrap

import pytest
import torch

import qgemv
from qgemv import _ext, formats, persist
from qgemv.weight import PackedWeight

from conftest import FORMATS

has_persist = _ext.MODULE is not None and hasattr(_ext.MODULE, "persist")
needs_ext = pytest.mark.skipif(not has_persist, reason="needs the CUDA extension (built without a GPU is fine)")
needs_sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and has_persist and
                                     torch.cuda.get_device_capability()[0] == 9),
                                reason="needs a compute-capability-9 GPU")


def fake_ops(shapes, outs=None, kps=None):
    """Plan tuples with made-up (never dereferenced) pointers: shapes [(N, K)], outs per op, kps: each op's
    padded K (0: K)."""
    outs = outs or [0] * len(shapes)
    kps = kps or [0] * len(shapes)
    return [(4096 * (4 * i + 1), 4096 * (4 * i + 2) if o == 1 else 0, 4096 * (4 * i + 3), 4096 * (4 * i + 4),
             4096 * (4 * i + 5), n, k, o, i == 0, False, i + 1 == len(shapes), 0, 0, -1, 0, kp)
            for i, ((n, k), o, kp) in enumerate(zip(shapes, outs, kps))]


LLAMA_LIKE = ([(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)], [0, 1, 2, 1])
SMALL = ([(384, 256), (256, 256), (1280, 256), (256, 640)], [0, 1, 2, 1])
BF16 = torch.bfloat16
# (format, activations' type): every format with float16 activations, bf16 weights with bf16 activations, and
# int4 / int8 with bfloat16 activations (staged inside the launch as fp16 of x 2^e)
CASES = ([(n, torch.float16) for n in persist.FORMATS if n != "bf16"] + [("bf16", BF16)]
         + [(n, BF16) for n in ("int4", "int4g128a", "int4g64", "int4g32a", "int8")])
CASE_IDS = [f"{n}-{str(d).replace('torch.', '')}" for n, d in CASES]  # e.g. int4g128a-bfloat16


@needs_ext
@pytest.mark.parametrize("shapes,outs", [LLAMA_LIKE, SMALL])
@pytest.mark.parametrize("blocks,warps", [(132, 16), (7, 5), (1, 1), (13, 16)])
@pytest.mark.parametrize("bits", [4, 8, 16])  # a tile: 128 int4 inputs of 16 rows, 64 int8 or 32 fp16
def test_schedule_assigns_every_tile_once(shapes, outs, blocks, warps, bits):
    ps = qgemv._ext.MODULE.persist
    ops = fake_ops(shapes * 2, outs * 2)  # two layers: the second reuses the first's classes
    group, zeros = (128, True) if bits == 4 else (0, False)
    err, table, sched, op_class, classes, sums, x_cap, stage, smem, attn, octets = ps.plan(
        ops, group, zeros, blocks, warps, 8, bits=bits)
    assert attn.numel() == 0 and not octets  # no attention: no octet form
    assert err == ""
    assert classes == 4 and op_class == [0, 1, 2, 3] * 2
    assert table.numel() == len(ops) * ps.op_bytes()
    assert x_cap == max(k for _, k in shapes)
    assert sched.shape == (classes, blocks, warps + 1, 4)
    most = 0
    for c, ((n, k), out) in enumerate(zip(shapes, outs)):
        ppu = 2 if out == 2 else 1  # SiLU * mul: a unit is a gate panel and its up panel
        units, tpp = n // 16 // ppu, k // {4: 128, 8: 64, 16: 32}[bits]
        seen = torch.zeros(n // 16, tpp, dtype=torch.int32)
        u_next = 0
        for b in range(blocks):
            u0, u1 = sched[c, b, warps, :2].tolist()
            assert u0 == u_next and u1 >= u0  # the blocks' units: contiguous, in order
            u_next = u1
            most = max(most, (u1 - u0) * ppu)
            pos_next = 0
            for w in range(warps):
                pos, end, vp, rest = sched[c, b, w].tolist()
                assert pos == pos_next and end >= pos  # the warps' runs: contiguous, in order
                pos_next = end
                assert vp == pos // tpp and rest & 0xFFFF == pos % tpp and rest >> 16 == u0
                for p in range(pos, end):  # the block's p-th tile -> the op's (panel, k-tile)
                    v, kt = divmod(p, tpp)
                    unit, half = divmod(v, ppu)
                    panel = u0 + unit + half * (n // 16 // 2)
                    seen[panel, kt] += 1
            assert pos_next == (u1 - u0) * ppu * tpp
        assert u_next == units
        assert bool((seen == 1).all()), f"class {c}: tiles assigned {seen.min()}..{seen.max()} times"
    assert sums == max(-(-(n // 16 // (2 if o == 2 else 1)) // blocks) * (2 if o == 2 else 1)
                       for (n, _), o in zip(shapes, outs)) * 16


@needs_ext
def test_plan_names_the_rule():
    ps = qgemv._ext.MODULE.persist
    bad_k = fake_ops([(256, 200)])  # int4 tiles take 128 inputs: K 200 needs a weight padded to 256
    assert "linear 0: Kp (the weight's K padded to whole tiles) must be K rounded up to a multiple of 128, got K " \
        "200, Kp 200" in ps.plan(bad_k, 0, False, 4, 4, 8)[0]
    assert ps.plan(fake_ops([(256, 200)], kps=[256]), 0, False, 4, 4, 8)[0] == ""
    assert "Kp 384" in ps.plan(fake_ops([(256, 200)], kps=[384]), 0, False, 4, 4, 8)[0]  # one tile too many
    assert "K must be a positive multiple of 8, got 196" in ps.plan(fake_ops([(256, 196)], kps=[256]), 0, False, 4,
                                                                    4, 8)[0]
    assert "K must be a multiple of the group size, got 200" in \
        ps.plan(fake_ops([(256, 200)], kps=[256]), 64, False, 4, 4, 8)[0]
    assert ps.plan(fake_ops([(256, 200)], kps=[224]), 0, False, 4, 4, 8, bits=16)[0] == ""  # fp16: 32-input tiles
    assert ps.plan(fake_ops([(256, 200)], kps=[256]), 0, False, 4, 4, 8, bits=8)[0] == ""  # int8: 64-input tiles
    assert "multiple of 64, got K 200, Kp 320" in ps.plan(fake_ops([(256, 200)], kps=[320]), 0, False, 4, 4, 8,
                                                         bits=8)[0]
    bad_silu = fake_ops([(256, 256), (272, 256)], [0, 2])
    assert "linear 1: N must be a positive multiple of 32 (SiLU * mul), got 272" in \
        ps.plan(bad_silu, 0, False, 4, 4, 8)[0]
    ok = fake_ops([(256, 256)])
    assert "group_size must be 0 (per channel), 32, 64 or 128, got 48" in ps.plan(ok, 48, False, 4, 4, 8)[0]
    assert "zero points need a group_size" in ps.plan(ok, 0, True, 4, 4, 8)[0]
    assert "bits must be 4 (int4), 8 (int8) or 16 (fp16 weights), got 2" in ps.plan(ok, 0, False, 4, 4, 8, bits=2)[0]
    assert "int8 and fp16 weights are per channel (group must be 0)" in ps.plan(ok, 128, False, 4, 4, 8, bits=16)[0]
    assert "stages must be an even number above 2, got 5" in ps.plan(ok, 0, False, 4, 4, 5)[0]
    assert "warps must be 1..16, got 17" in ps.plan(ok, 0, False, 4, 17, 8)[0]
    many = fake_ops([(256 + 16 * j, 256) for j in range(9)])
    assert "more distinct linear shapes than the schedule holds: 8" in ps.plan(many, 0, False, 4, 4, 8)[0]
    short = [t[:11] + (200,) + t[12:] for t in fake_ops([(256, 256)])]
    assert "linear 0: ldx must be 0 or at least K, got 200" in ps.plan(short, 0, False, 4, 4, 8)[0]
    # an act-order op (a perm pointer): a second input buffer of x_cap fp16 in shared memory
    plain, permuted = fake_ops(*LLAMA_LIKE), [t[:14] + (8192 * 99,) + t[15:] for t in fake_ops(*LLAMA_LIKE)]
    a, b = ps.plan(plain, 128, True, 132, 16, 8), ps.plan(permuted, 128, True, 132, 16, 8)
    assert a[0] == b[0] == "" and (a[7], b[7]) == (0, 1)
    assert 0 <= b[8] - a[8] - 2 * a[6] < 128  # (the ring starts on a 128-byte boundary)


@needs_ext
@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("group", [128, 64, 32])
def test_fused_tiles_hold_codes_then_scales(zeros, group):
    """Each 1 KB tile, then for each g in 0..7 and group i of the tile the scales of rows g and g + 8, then their
    zero points in the same order (csrc/persist_chain.cuh, chain_meta)."""
    ps = qgemv._ext.MODULE.persist
    n, k, gpt = 48, 384, 128 // group
    w = torch.randn(n, k)
    qw, s, z = formats.quantize_int4(w, group, symmetric=not zeros)
    fused = ps.fuse(qw, s, z if zeros else torch.empty(0, dtype=torch.uint8), n, k, group)
    ts = ps.tile_bytes(group, zeros)
    assert ts == 1024 + -(-16 * gpt * (3 if zeros else 2) // 16) * 16
    tiles = n // 16 * (k // 128)
    assert fused.numel() == tiles * ts
    raw = qw.contiguous().view(torch.uint8).reshape(tiles, 1024)  # the packed panels are the tile stream
    f = fused.reshape(tiles, ts)
    assert torch.equal(f[:, :1024], raw)
    s16 = s.view(torch.int16)
    for pn in range(n // 16):
        for kt in range(k // 128):
            meta = f[pn * (k // 128) + kt, 1024:]
            for g in range(8):
                for i in range(gpt):
                    for h in range(2):
                        row, col, at = pn * 16 + g + 8 * h, kt * gpt + i, g * gpt + i
                        got = meta[4 * at + 2 * h: 4 * at + 2 * h + 2].view(torch.int16).item()
                        assert got == s16[row, col].item()
                        if zeros:
                            assert meta[32 * gpt + 2 * at + h].item() == z[row, col].item()


@pytest.mark.parametrize("name", ["int4", "int4g32a", "int4g64", "int8", "fp16"])
def test_pad_inputs_adds_exact_zero_weights(name):
    torch.manual_seed(4)
    w = packed(name, 48, 320)
    k = 384 if name.startswith("int4") else 320 + 64
    p = persist.pad_inputs(w, k)
    dq = (lambda v: v.float()) if name == "fp16" else (lambda v: v.dequantize())
    assert persist._shape(p) == (48, k)
    assert torch.equal(dq(p)[:, :320], dq(w)) and bool((dq(p)[:, 320:] == 0).all())
    assert persist.pad_inputs(w, 320) is w
    if name != "fp16":  # act-order: the perm stays [K], indexing the first K stored inputs
        perm = torch.randperm(320)
        wp = PackedWeight(w.qweight, w.scales, w.zeros, w.config, 320, perm)
        pp = persist.pad_inputs(wp, k)
        assert torch.equal(pp.perm, perm) and torch.equal(pp.dequantize(), wp.dequantize())
    with pytest.raises(persist.PersistError, match="pad_inputs: k 256 is below the weight's K 320"):
        persist.pad_inputs(w, 256)


@needs_ext
@pytest.mark.parametrize("name", ["int4g128", "int4g128a", "int4g64", "int4g64a", "int4g32", "int4g32a"])
def test_tile_meta_is_the_extensions_meta_with_torch(name):
    """tile_meta (torch, on the weight's device) against the extension's C++ fuse, whose tiles are the packed
    codes as they lie (the launch reads them in place) each followed by its meta: byte for byte, and the codes
    equal to qweight's; on the GPU too where there is one."""
    w = packed(name, 48, 384)
    cfg = FORMATS[name]
    fused = qgemv._ext.MODULE.persist.fuse(w.qweight, w.scales, w.zeros if w.zeros is not None else
                                           torch.empty(0, dtype=torch.uint8), 48, 384, cfg.group_size)
    tiles = 48 // 16 * (384 // 128)
    fused = fused.reshape(tiles, -1)
    assert torch.equal(fused[:, :1024].reshape(-1), w.qweight.contiguous().view(torch.uint8).reshape(-1))
    want = fused[:, 1024:].reshape(-1)
    assert want.numel() == tiles * 16 * (128 // cfg.group_size) * (3 if w.zeros is not None else 2)
    assert torch.equal(persist.tile_meta(w), want)
    if torch.cuda.is_available():
        got = persist.tile_meta(w.to("cuda"))
        assert got.device.type == "cuda" and torch.equal(got.cpu(), want)


def test_tile_meta_checks_in_python():
    with pytest.raises(persist.PersistError, match=r"tile_meta: format int4, expected grouped int4 \(G = 32, 64"):
        persist.tile_meta(PackedWeight(*formats.quantize_int4(torch.randn(32, 256)), FORMATS["int4"], 256))


# The extension's own checks, behind the Python ones (on torch 2.11 an exception out of the extension ends
# the process: ops._precheck_cuda).
@needs_ext
@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13),
                    reason="C++ exceptions end the process on this torch")
def test_fuse_checks_its_tensors():
    ps = qgemv._ext.MODULE.persist
    qw, s, _ = formats.quantize_int4(torch.randn(32, 256), 128)
    none = torch.empty(0, dtype=torch.uint8)
    with pytest.raises(ValueError, match="qgemv.persist.fuse: scales must be contiguous float16"):
        ps.fuse(qw, s.float(), none, 32, 256)
    with pytest.raises(ValueError, match="qgemv.persist.fuse: N must be a multiple of 16 and K of 128"):
        ps.fuse(qw, s, none, 32, 200)


def packed(name, n, k, gain=0.3):
    """A weight [n, k] in format ``name`` (persist.FORMATS): a PackedWeight, or for "fp16" / "bf16" a float16 /
    bfloat16 tensor."""
    w = torch.randn(n, k) * (gain / k ** 0.5)
    if name in ("fp16", "bf16"):
        return w.to(torch.bfloat16 if name == "bf16" else torch.float16)
    cfg = FORMATS[name]
    qw, s, z = formats.quantize(w, cfg)
    return PackedWeight(qw, s, z, cfg, k)


def assert_close_chain(y, ref, x, what):
    """y against the per-op chain's ref, measured on what the layers add to their input x (the residual
    stream carries x through unchanged and would hide errors in the layers' part), plus two steps of the
    output's type at its magnitude (where the residual adds round; the two chains sum in other orders).
    In both types the launch measured within the two steps (H100, 2026-12-05: dev/bf16_errors.py)."""
    assert y.dtype == ref.dtype, f"{what}: {y.dtype} against the reference's {ref.dtype}"
    assert torch.isfinite(y).all(), f"{what}: non-finite outputs"
    bf16 = y.dtype == torch.bfloat16
    added = (ref.float() - x.float()).abs().max().item()
    step = 2.0 ** (math.floor(math.log2(ref.float().abs().max().item())) - (7 if bf16 else 10))
    diff = (y.float() - ref.float()).abs().max().item()
    assert diff <= 3e-2 * added + 2 * step, f"{what}: error {diff:.3g}, the layers add {added:.3g}"


def act_order(layers, seed=11):
    """The layers with a random act-order input perm on every weight (one per linear, as GPTQ's desc_act)."""
    gen = torch.Generator().manual_seed(seed)
    for layer in layers:
        for w in layer:
            w.perm = torch.randperm(w.in_features, generator=gen).to(w.qweight.device)
    return layers


def make_layers(name, layers, h, nqkv, inter, device="cpu"):
    return [tuple(w.to(device) for w in (packed(name, nqkv, h), packed(name, h, h), packed(name, 2 * inter, h),
                                          packed(name, h, inter))) for _ in range(layers)]


def test_chain_refuses_what_it_cannot_run():
    if not has_persist:
        with pytest.raises(persist.PersistError, match="needs the CUDA extension"):
            persist.PersistentChain(make_layers("int4", 1, 256, 384, 640))
        return
    with pytest.raises(persist.PersistError, match="must be on a CUDA device"):
        persist.PersistentChain(make_layers("int4", 1, 256, 384, 640))
    with pytest.raises(persist.PersistError, match="must be on a CUDA device"):  # act-order weights pass the format
        persist.PersistentChain(act_order(make_layers("int4g128a", 1, 256, 384, 640)))
    mixed = make_layers("int4", 1, 256, 384, 640)
    mixed[0] = (mixed[0][0], packed("int4g128", 256, 256)) + mixed[0][2:]
    with pytest.raises(persist.PersistError, match="layer 0 o: every weight must share one format"):
        persist.PersistentChain(mixed)
    with pytest.raises(persist.PersistError, match="must be on a CUDA device"):  # fp16 weights pass the format
        persist.PersistentChain(make_layers("fp16", 1, 256, 384, 640))
    fp32 = make_layers("fp16", 1, 256, 384, 640)
    fp32[0] = (fp32[0][0].float(),) + fp32[0][1:]
    with pytest.raises(persist.PersistError,
                       match=r"layer 0 qkv: a tensor weight must be float16 or bfloat16 \[N, K\]"):
        persist.PersistentChain(fp32)
    with pytest.raises(persist.PersistError, match="must be on a CUDA device"):  # bf16 weights, bf16 activations
        persist.PersistentChain(make_layers("bf16", 1, 256, 384, 640))
    with pytest.raises(persist.PersistError, match="must be on a CUDA device"):  # int4, bf16 activations
        persist.PersistentChain(make_layers("int4", 1, 256, 384, 640), dtype=torch.bfloat16)
    with pytest.raises(persist.PersistError,
                       match="layer 0 qkv: a torch.bfloat16 weight with torch.float16 activations"):
        persist.PersistentChain(make_layers("bf16", 1, 256, 384, 640), dtype=torch.float16)
    with pytest.raises(persist.PersistError, match="dtype must be torch.float16 or torch.bfloat16, got torch.float32"):
        persist.PersistentChain(make_layers("int4", 1, 256, 384, 640), dtype=torch.float32)
    mixed[0] = (packed("fp16", 384, 256),) + mixed[0][1:]
    with pytest.raises(persist.PersistError, match="layer 0 o: every weight must share one format, got int4g128 after fp16"):
        persist.PersistentChain(mixed)
    bad = make_layers("int4", 1, 256, 384, 640)
    bad[0] = bad[0][:3] + (packed("int4", 256, 512),)
    with pytest.raises(persist.PersistError, match="layer 0 down: shape 256 x 512, expected 256 x 640"):
        persist.PersistentChain(bad)


@needs_sm90
@pytest.mark.parametrize("name,dt", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dims,grid", [((256, 384, 640, 3), {}), ((384, 640, 1152, 2), dict(blocks=7, warps=5, stages=4)),
                                       ((512, 768, 1024, 4), dict(blocks=61, warps=16, stages=8)),
                                       # K 320 and 832: int4 weights padded to whole 128-input tiles (pad_inputs)
                                       ((320, 448, 832, 2), dict(blocks=7, warps=5, stages=4))])
def test_chain_matches_the_per_op_chain(name, dt, dims, grid):
    h, nqkv, inter, nl = dims
    skip_if_group_cuts(name, h, inter)
    layers = make_layers(name, nl, h, nqkv, inter, "cuda")
    chain = persist.PersistentChain(layers, dtype=dt, **grid)
    for trial in range(3):  # several launches: the epoch moves on each time
        x = torch.randn(1, h, device="cuda", dtype=dt)
        chain.output.fill_(float("nan"))
        y = chain(x)
        ref = persist.reference(layers, x)
        assert_close_chain(y, ref, x, f"trial {trial}")
        # every activation buffer: this launch's copy all written, the other all poison for the next launch
        # (launch t, counted from 0, writes copy t % 2)
        for buf in chain._acts:
            copies = buf.view(torch.int16).view(2, -1)
            assert not (copies[trial % 2] == -1).any() and bool((copies[1 - trial % 2] == -1).all())


def skip_if_group_cuts(name, *ks):
    g = FORMATS[name].group_size if name not in ("fp16", "bf16") else None
    if g and any(k % g for k in ks):
        pytest.skip(f"{name}: K {ks} is not a multiple of its group size {g} (no such weight)")


def random_norms(layers, h, dt=torch.float16):
    return [tuple((0.5 + torch.rand(h, device="cuda")).to(dt) for _ in range(2)) for _ in range(layers)]


@needs_sm90
@pytest.mark.parametrize("name,dt", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dims,grid", [((256, 384, 640, 3), {}), ((384, 640, 1152, 2), dict(blocks=7, warps=5, stages=4))])
def test_chain_with_rms_norms_matches_the_per_op_chain(name, dt, dims, grid):
    h, nqkv, inter, nl = dims
    layers = make_layers(name, nl, h, nqkv, inter, "cuda")
    norms = random_norms(nl, h, dt)
    chain = persist.PersistentChain(layers, norms=norms, eps=1e-5, dtype=dt, **grid)
    for trial in range(3):
        # inputs far from unit scale: the norm, not the weights, sets the linears' input scale
        x = (torch.randn(1, h, device="cuda") * 4 ** trial).to(dt)
        chain.output.fill_(float("nan"))
        y = chain(x)
        ref = persist.reference(layers, x, norms, 1e-5)
        assert_close_chain(y, ref, x, f"trial {trial}")
        # and the norms change the result: the chain without them is another function
        plain = persist.reference(layers, x)
        added = (ref.float() - x.float()).abs().max()
        assert ((plain.float() - ref.float()).abs().max() / added).item() > 0.1



@needs_sm90
@pytest.mark.parametrize("name", ["int4", "int4g128a", "int4g32a", "int8"])
@pytest.mark.parametrize("scale", [1e6, 1e-6])
def test_bf16_chain_takes_inputs_outside_fp16s_range(name, scale):
    """bfloat16 activations into int4 / int8 weights are staged as fp16 of x 2^e inside the launch: inputs far
    above fp16's largest value (65504) or below its smallest normal (6e-5) must come through as bf16 ones do,
    without norms (the first op reads x itself) and through every layer after it."""
    torch.manual_seed(12)
    layers = make_layers(name, 2, 256, 384, 640, "cuda")
    chain = persist.PersistentChain(layers, dtype=BF16)
    for trial in range(2):
        x = (torch.randn(1, 256, device="cuda") * scale).to(BF16)
        y = chain(x)
        assert_close_chain(y, persist.reference(layers, x), x, f"|x| ~ {scale:g}, trial {trial}")


@needs_sm90
@pytest.mark.parametrize("name", ["int4g128a", "int8"])
@pytest.mark.parametrize("scale", [1e6, 1e-6])
def test_bf16_chain_takes_norm_gains_outside_fp16s_range(name, scale):
    """A normed hand-off of bf16 activations bounds its input by max|x| r max|gain|, max|gain| read from
    after the gain (norm_gain): with gains of 1e6 or 1e-6 every normed input lies outside fp16's range,
    so a wrong or missing bound overflows fp16 or drops its bits."""
    torch.manual_seed(13)
    layers = make_layers(name, 2, 256, 384, 640, "cuda")
    norms = [tuple((g.float() * scale).to(BF16) for g in pair) for pair in random_norms(2, 256, BF16)]
    chain = persist.PersistentChain(layers, norms=norms, eps=1e-5, dtype=BF16)
    x = torch.randn(1, 256, device="cuda").to(BF16)
    assert_close_chain(chain(x), persist.reference(layers, x, norms, 1e-5), x, f"gains ~ {scale:g}")


def test_norm_gain_appends_the_gains_largest_magnitude():
    for dt in (torch.float16, BF16):
        g = (torch.rand(40) * 2 - 1).to(dt)
        g[7] = -9.5
        g[9] = float("nan")
        perm = torch.randperm(40)
        out = persist.norm_gain(g, perm)
        assert out.dtype == dt and out.shape == (48,)
        assert torch.equal(out[:40].view(torch.int16), g[perm].view(torch.int16))  # (the NaN's bits too)
        assert out[40:42].view(torch.float32).item() == 9.5  # NaNs ignored
        assert torch.equal(out[42:], torch.zeros(6, dtype=dt))
        assert torch.equal(persist.norm_gain(g)[:40].view(torch.int16), g.view(torch.int16))


@needs_sm90
@pytest.mark.parametrize("name,dt", [("int4", torch.float16), ("int4g128a", torch.float16), ("int4g32", torch.float16),
                                     ("int8", torch.float16), ("int4g128a", BF16), ("int8", BF16)],
                         ids=["int4", "int4g128a", "int4g32", "int8", "int4g128a-bfloat16", "int8-bfloat16"])
def test_act_order_chain_matches_the_per_op_chain(name, dt):
    """Every linear with its own act-order input perm: each op gathers its input inside the launch (after its
    RMSNorm, whose gain it reads in the stored order), without norms, with them, and with attention."""
    torch.manual_seed(9)
    layers = act_order(make_layers(name, 2, 256, 384, 640, "cuda"))
    norms = random_norms(2, 256, dt)
    for chain, ns in ((persist.PersistentChain(layers, dtype=dt), None),
                      (persist.PersistentChain(layers, norms=norms, dtype=dt), norms)):
        for trial in range(2):
            x = torch.randn(1, 256, device="cuda", dtype=dt)
            y = chain(x)
            assert_close_chain(y, persist.reference(layers, x, ns), x, f"norms {ns is not None}, trial {trial}")
    layers, norms, at = decode_setup(name, 4, 2, 64, 640, 2, 48, dt=dt)
    act_order(layers)
    chain = persist.PersistentChain(layers, norms=norms, attention=at, dtype=dt)
    for pos in (0, 20, 47):
        x = torch.randn(1, 256, device="cuda").to(dt)
        ref_at = persist.Attention(4, 2, 64, at.cos, at.sin, at.k_cache.clone(), at.v_cache.clone())
        y = chain(x, position=pos)
        assert_close_chain(y, persist.reference(layers, x, norms, 1e-5, attention=ref_at, position=pos), x,
                           f"attention at {pos}")

@needs_sm90
def test_chain_checks_its_norms():
    layers = make_layers("int4", 2, 256, 384, 640, "cuda")
    good = random_norms(2, 256)
    with pytest.raises(persist.PersistError, match="norms: 1 pairs of gains for 2 layers"):
        persist.PersistentChain(layers, norms=good[:1])
    with pytest.raises(persist.PersistError, match=r"norms\[1\] post-attention: must be float16 \[256\]"):
        persist.PersistentChain(layers, norms=[good[0], (good[1][0], good[1][1].float())])
    with pytest.raises(persist.PersistError, match="eps must be positive"):
        persist.PersistentChain(layers, norms=good, eps=0.0)


@needs_sm90
def test_chain_replays_in_a_cuda_graph():
    layers = make_layers("int4g128a", 2, 256, 384, 640, "cuda")
    chain = persist.PersistentChain(layers)
    chain.input.copy_(torch.randn(1, 256, device="cuda", dtype=torch.float16))
    chain.run()  # warm-up outside the capture
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            chain.run()
    for _ in range(3):
        x = torch.randn(1, 256, device="cuda", dtype=torch.float16)
        chain.input.copy_(x)
        chain.output.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref = persist.reference(layers, x)
        assert_close_chain(chain.output, ref, x, "graph replay")


@needs_sm90
def test_a_grid_that_cannot_be_co_resident_is_refused_not_hung():
    # In a child process with a timeout: a hang fails the test instead of stalling the suite.
    code = textwrap.dedent("""
        import torch, qgemv
        from qgemv import persist
        import test_persist as t
        layers = t.make_layers("int4", 1, 256, 384, 640, "cuda")
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        try:
            persist.PersistentChain(layers, blocks=2 * sms + 1)
            print("ACCEPTED")
        except persist.PersistError as e:
            print("REFUSED", e)
        chain = persist.PersistentChain(layers)
        ps = qgemv._ext.MODULE.persist
        # past the refusal check: the cooperative launch itself must refuse (a grid it would run is the
        # chain's own schedule for fewer blocks: never launched here)
        why = ps.launch(chain._table, chain._schedule, chain._sync, chain.group, chain.zeros, 2 * sms + 1,
                        chain.warps, chain.stages, chain.classes, chain.sums, chain.x_cap, chain.smem)
        torch.cuda.synchronize()
        print("LAUNCH REFUSED" if why else "LAUNCHED", why)
    """)
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=here)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "REFUSED" in r.stdout and "co-resident" in r.stdout, r.stdout
    assert "LAUNCH REFUSED" in r.stdout, r.stdout


# ---- stage 2: RoPE, the KV-cache write and attention inside the launch ----

@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 128), (4, 4, 64), (8, 1, 32)])
def test_rope_rows_put_each_rotation_pair_in_one_panel(heads, kv_heads, head_dim):
    rows = persist.rope_rows(heads, kv_heads, head_dim)
    n = (heads + 2 * kv_heads) * head_dim
    assert sorted(rows.tolist()) == list(range(n))  # a permutation
    half = head_dim // 2
    for start in range(0, (heads + kv_heads) * head_dim, 16):  # q and k panels: row r pairs with r + 8
        lo, hi = rows[start:start + 8], rows[start + 8:start + 16]
        assert (hi - lo == half).all() and (lo // head_dim == start // head_dim).all() and (lo % head_dim < half).all()
    assert rows[(heads + kv_heads) * head_dim:].tolist() == list(range((heads + kv_heads) * head_dim, n))  # v
    if has_persist:  # the kernel's own copy of the rule
        assert qgemv._ext.MODULE.persist.rope_rows(heads, kv_heads, head_dim) == rows.tolist()


@pytest.mark.parametrize("name", persist.FORMATS)
def test_permute_rows_is_exact(name):
    w = packed(name, 96, 256)
    rows = torch.randperm(96)
    p = persist.permute_rows(w, rows)
    if name == "fp16":
        assert torch.equal(p, w[rows])
    else:
        assert torch.equal(p.dequantize(), w.dequantize()[rows])


def test_reference_attention_is_sdpa_after_rope():
    torch.manual_seed(3)
    h, hk, d, s, pos = 8, 2, 64, 40, 29
    cos, sin = rope_tables(s, d, "cpu")
    at = persist.Attention(h, hk, d, cos, sin, torch.randn(1, hk, s, d).half(), torch.randn(1, hk, s, d).half())
    qkv = torch.randn(1, (h + 2 * hk) * d).half()
    out = persist.attend(at, 0, qkv, pos)
    f = qkv[0].float()
    rot = (lambda t: (t * cos[pos].float() + torch.cat((-t[..., d // 2:], t[..., :d // 2]), -1) * sin[pos].float()))
    q = rot(f[:h * d].view(h, d)).half()
    assert torch.equal(at.k_cache[0, :, pos], rot(f[h * d:(h + hk) * d].view(hk, d)).half())
    assert torch.equal(at.v_cache[0, :, pos], f[(h + hk) * d:].view(hk, d).half())
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float()[None, :, None], at.k_cache[:, :, :pos + 1].float(), at.v_cache[:, :, :pos + 1].float(),
        enable_gqa=True)
    assert torch.allclose(out.float(), ref.reshape(1, h * d), atol=2e-3, rtol=2e-3)


def attn_ops(h, hk, d, inter=640, roles=((1, 0), (2, 0))):
    hid = h * d
    ops = fake_ops([((h + 2 * hk) * d, hid), (hid, hid), (2 * inter, hid), (hid, inter)], [0, 1, 2, 1])
    ops = [t[:8] + (False,) + t[9:12] + (0, -1, 0, 0) for t in ops]  # every buffer inside the launch
    (r1, a1), (r2, a2) = roles
    ops[0] = ops[0][:12] + (r1, a1, 0, 0)
    ops[1] = ops[1][:12] + (r2, a2, 0, 0)
    return ops


def attn_tuple(h, hk, d, s=64, splits=4, per_warp=0):
    return (8192, 8192 * 2, 8192 * 3, 8192 * 4, 8192 * 5, 8192 * 6, h, hk, d, s, splits, d ** -0.5, 0, 0, 0, 0, 0, 1e-6,
            per_warp)


def reference_layer(seed, h, hk, d, s, inter=256):
    """One int4 layer for heads h over hk of head_dim d, its two norm gains and rotary tables of s positions (CPU);
    the generator seeded first."""
    torch.manual_seed(seed)
    hid, n = h * d, (h + 2 * hk) * d
    layers = [(packed("int4", n, hid), packed("int4", hid, hid), packed("int4", 2 * inter, hid),
               packed("int4", hid, inter))]
    norms = [tuple((0.5 + torch.rand(hid)).half() for _ in range(2))]
    return (layers, norms, *rope_tables(s, d, "cpu"))


def test_reference_adds_the_qkv_bias_before_the_rotation():
    """persist.reference (the kernel's yardstick) adds Qwen2's q/k/v bias to the rounded q/k/v output, as the
    per-op linear does, then rotates: the k it writes into the cache is RoPE(round(W x) + b), v is W x + b."""
    from qgemv.engine import apply_rope
    from qgemv.ops import linear

    h, hk, d, s, pos = 4, 2, 64, 16, 5
    hid, n = h * d, (h + 2 * hk) * d
    layers, norms, cos, sin = reference_layer(4, h, hk, d, s)
    bias = (torch.randn(1, n) * 0.5).half()

    def caches():
        return torch.zeros(1, hk, s, d).half(), torch.zeros(1, hk, s, d).half()

    at = persist.Attention(h, hk, d, cos, sin, *caches(), qkv_bias=bias)
    plain = persist.Attention(h, hk, d, cos, sin, *caches())
    x = torch.randn(1, hid).half()
    persist.reference(layers, x, norms, 1e-5, attention=at, position=pos)
    persist.reference(layers, x, norms, 1e-5, attention=plain, position=pos)
    q = linear(persist.rms_norm(x, norms[0][0], 1e-5), layers[0][0]) + bias[0]
    f = q[0].float()
    k = apply_rope(f[h * d:(h + hk) * d].view(hk, d), cos[pos].float(), sin[pos].float()).half()
    assert torch.equal(at.k_cache[0, :, pos], k)
    assert torch.equal(at.v_cache[0, :, pos], q[0, (h + hk) * d:].view(hk, d))
    assert not torch.equal(at.v_cache[0, :, pos], plain.v_cache[0, :, pos])


def test_reference_norms_each_q_and_k_head_before_the_rotation():
    """Qwen3: persist.reference (the kernel's yardstick) writes k = RoPE(rms_norm(k_head, k_norm)) into the
    cache, each head normalized over its head_dim with transformers' rounding; v as it is."""
    from qgemv.engine import apply_rope
    from qgemv.ops import linear

    h, hk, d, s, pos = 4, 2, 64, 16, 7
    hid = h * d
    layers, norms, cos, sin = reference_layer(6, h, hk, d, s)
    qn, kn = ((0.5 + torch.rand(1, d)).half() for _ in range(2))
    at = persist.Attention(h, hk, d, cos, sin, torch.zeros(1, hk, s, d).half(), torch.zeros(1, hk, s, d).half(),
                           q_norm=qn, k_norm=kn, qk_eps=1e-5)
    x = torch.randn(1, hid).half()
    persist.reference(layers, x, norms, 1e-5, attention=at, position=pos)
    q = linear(persist.rms_norm(x, norms[0][0], 1e-5), layers[0][0])
    kh = persist.rms_norm(q[0, h * d:(h + hk) * d].view(hk, d), kn[0], 1e-5)
    want = apply_rope(kh.float(), cos[pos].float(), sin[pos].float()).half()
    assert torch.equal(at.k_cache[0, :, pos], want)
    assert torch.equal(at.v_cache[0, :, pos], q[0, (h + hk) * d:].view(hk, d))


@needs_ext
def test_plan_checks_the_attention():
    ps = qgemv._ext.MODULE.persist
    ok = ps.plan(attn_ops(8, 2, 64), 0, False, 8, 16, 8, [attn_tuple(8, 2, 64)])
    assert ok[0] == "" and ok[9].numel() > 0 and ok[6] >= 8 * 64 and ok[7] == 0  # no perm: no second input buffer
    assert "attention 0: heads must be a multiple of kv_heads" in \
        ps.plan(attn_ops(8, 3, 64), 0, False, 8, 16, 8, [attn_tuple(8, 3, 64)])[0]
    assert "at most 8 query heads a kv head" in \
        ps.plan(attn_ops(16, 1, 32), 0, False, 8, 16, 8, [attn_tuple(16, 1, 32)])[0]
    assert "head_dim must be 32, 64 or 128, got 80" in \
        ps.plan(attn_ops(8, 2, 80), 0, False, 8, 16, 8, [attn_tuple(8, 2, 80)])[0]
    assert "needs a warp a query head of a kv head: warps must be at least 4, got 2" in \
        ps.plan(attn_ops(4, 1, 64), 0, False, 8, 2, 8, [attn_tuple(4, 1, 64)])[0]
    assert "the q/k/v linear must have N = (heads + 2 kv_heads) head_dim = 1024 and a plain output, got N = 768" in \
        ps.plan(attn_ops(8, 2, 64), 0, False, 8, 16, 8, [attn_tuple(8, 4, 64)])[0]
    assert "attention 0: needs its q/k/v linear (role 1) and the linear after it (role 2)" in \
        ps.plan(attn_ops(8, 2, 64, roles=((1, 0), (0, -1))), 0, False, 8, 16, 8, [attn_tuple(8, 2, 64)])[0]
    assert "linear 1: role must be 1 or 2 with attn in 0..0, got role 2 attn 1" in \
        ps.plan(attn_ops(8, 2, 64, roles=((1, 0), (2, 1))), 0, False, 8, 16, 8, [attn_tuple(8, 2, 64)])[0]
    assert "max_seq and splits must be positive" in \
        ps.plan(attn_ops(8, 2, 64), 0, False, 8, 16, 8, [attn_tuple(8, 2, 64, splits=0)])[0]
    assert "per_warp must be 0 (2) or 1..64, got 65" in \
        ps.plan(attn_ops(8, 2, 64), 0, False, 8, 16, 8, [attn_tuple(8, 2, 64, per_warp=65)])[0]


@needs_ext
def test_chain_attention_form_knob():
    testing = qgemv._ext.MODULE.testing
    before = testing.chain_attention_form()
    assert before == -1  # the rule by default
    for bad in (2, -2):
        with pytest.raises(ValueError, match=f"form must be -1, 0 or 1, got {bad}"):
            testing.set_chain_attention_form(bad)
        assert testing.chain_attention_form() == before
    try:
        for form in (0, 1):
            testing.set_chain_attention_form(form)
            assert testing.chain_attention_form() == form
    finally:
        testing.set_chain_attention_form(before)


@needs_ext
def test_plan_takes_the_octet_kernel_only_where_the_form_can_run():
    # the decode kernel with the octet form spills (dev/PERSISTENT.md); the plan asks for it only where the rule
    # (4 or more query heads a kv head) or a forced form 1 can take octets, and for the one without where form 0
    ps, testing = qgemv._ext.MODULE.persist, qgemv._ext.MODULE.testing
    before = testing.chain_attention_form()
    want = {(-1, 8, 8): False, (-1, 8, 2): True, (-1, 8, 1): True, (-1, 12, 3): True, (-1, 6, 2): False,
            (1, 8, 8): True, (0, 8, 2): False}
    try:
        for (form, heads, kv), octets in want.items():
            testing.set_chain_attention_form(form)
            out = ps.plan(attn_ops(heads, kv, 64), 0, False, 8, 16, 8, [attn_tuple(heads, kv, 64)])
            assert out[0] == "" and out[10] is octets, (form, heads, kv)
    finally:
        testing.set_chain_attention_form(before)


@needs_ext
def test_chain_attention_prefetch_knob():
    testing = qgemv._ext.MODULE.testing
    before = testing.chain_attention_prefetch()
    assert before is None  # the rule by default
    for bad in (65, -65, -1000):
        with pytest.raises(ValueError, match=rf"tiles must be None \(the rule\) or in \[-64, 64\], got {bad}"):
            testing.set_chain_attention_prefetch(bad)
        assert testing.chain_attention_prefetch() is None
    try:
        for tiles in (-64, 0, 8, 64):
            testing.set_chain_attention_prefetch(tiles)
            assert testing.chain_attention_prefetch() == tiles
        testing.set_chain_attention_prefetch(None)
        assert testing.chain_attention_prefetch() is None
    finally:
        testing.set_chain_attention_prefetch(before)


def rope_tables(s, d, device, dt=torch.float16):
    """cos / sin [s, d] (dt) as transformers' rotary modules make them (the halves repeated)."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.arange(s, dtype=torch.float32)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], -1)
    return ang.cos().to(dt).to(device), ang.sin().to(dt).to(device)


def decode_setup(name, h, hk, d, inter, nl, s, device="cuda", dt=torch.float16):
    hid = h * d
    layers = [tuple(w.to(device) for w in (packed(name, (h + 2 * hk) * d, hid), packed(name, hid, hid),
                                            packed(name, 2 * inter, hid), packed(name, hid, inter)))
              for _ in range(nl)]
    cos, sin = rope_tables(s, d, device, dt)
    kc = (torch.randn(nl, hk, s, d, device=device) * 2).to(dt)
    vc = torch.randn(nl, hk, s, d, device=device).to(dt)
    return layers, random_norms(nl, hid, dt), persist.Attention(h, hk, d, cos, sin, kc, vc)


def assert_close_cache(got, ref, what):
    step = 2.0 ** (math.floor(math.log2(ref.float().abs().max().item())) - (7 if got.dtype == BF16 else 10))
    diff = (got.float() - ref.float()).abs().max().item()
    assert diff <= 2e-2 * ref.float().abs().max().item() + 2 * step, f"{what}: error {diff:.3g}"


@needs_sm90
@pytest.mark.parametrize("name,dt", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("cfg", [
    # GQA 4, head_dim 128, the default splits (a few positions a unit)
    dict(h=8, hk=2, d=128, inter=1536, nl=2, s=192, splits=None, grid={}),
    # no GQA, an odd grid, 2 splits a kv head: up to 65 positions a unit, three chunks
    dict(h=4, hk=4, d=64, inter=640, nl=2, s=130, splits=2, grid=dict(blocks=7, warps=5, stages=4)),
    # GQA 8, one unit a kv head: the whole context in 10 chunks, nothing to merge
    dict(h=8, hk=1, d=64, inter=1024, nl=3, s=300, splits=1, grid=dict(blocks=61)),
    # GQA 2 with Qwen2's q/k/v biases
    dict(h=4, hk=2, d=64, inter=640, nl=2, s=80, splits=None, grid={}, bias=True),
    # Qwen3's per-head q / k RMSNorms, on the default grid and on 7 blocks (a head's rows in several blocks)
    dict(h=8, hk=2, d=128, inter=1024, nl=2, s=64, splits=None, grid={}, qk_norm=True),
    dict(h=4, hk=2, d=64, inter=640, nl=2, s=64, splits=2, grid=dict(blocks=7, warps=5, stages=4), qk_norm=True),
    # hidden 320 and intermediate 832 (not multiples of 128: int4 padded to whole tiles), GQA 5: a warp of the
    # 16 without a query head, contexts of up to 5 chunks in 2 splits (the chunk race of 2026-12-05)
    dict(h=5, hk=1, d=64, inter=832, nl=2, s=160, splits=None, grid={}),
    # GQA 7 (Qwen2.5-7B's group), head_dim 128, one split of up to 4 chunks
    dict(h=7, hk=1, d=128, inter=1024, nl=2, s=100, splits=1, grid={}),
    # contexts split early (a position a warp: 16 positions a unit), up to 16 splits merged; and 2 a warp on an
    # odd grid (10 positions a unit, a chunk cut short)
    dict(h=8, hk=2, d=128, inter=1024, nl=2, s=260, splits=None, grid={}, per_warp=1),
    dict(h=4, hk=2, d=64, inter=640, nl=2, s=130, splits=8, grid=dict(blocks=7, warps=5, stages=4), per_warp=2),
    # no GQA at head_dim 32, one split of up to 7 chunks (the rule: a warp a position)
    dict(h=8, hk=8, d=32, inter=512, nl=2, s=200, splits=1, grid={}),
    # either form forced (testing.set_chain_attention_form; the rule takes octets where a kv head has 4 query
    # heads or more and a unit 128 positions or more: cfg2 past position 127): octets without GQA at head_dim 128
    # (Llama-2-7B's heads: half the warps without a position of a chunk) and at head_dim 32 (a lane's 4 dims in
    # one 8-byte load); a warp a position on GQA 5's contexts of up to 5 chunks
    dict(h=4, hk=4, d=128, inter=1024, nl=2, s=300, splits=2, grid={}, form=1),
    dict(h=8, hk=8, d=32, inter=512, nl=2, s=200, splits=1, grid={}, form=1),
    dict(h=5, hk=1, d=64, inter=832, nl=2, s=160, splits=None, grid={}, form=0),
    # GQA 7 under the rule: one split, the old form up to 127 positions, octets from 128 (two warps of 16 idle)
    dict(h=7, hk=1, d=128, inter=1024, nl=2, s=200, splits=1, grid={}),
    # the walks' next tiles asked into L2 at each attention (testing.set_chain_attention_prefetch), a hint that
    # must change no value: 16 a warp before the units; 64 after them (at the last layer past the walk's end)
    dict(h=8, hk=2, d=128, inter=1536, nl=2, s=192, splits=None, grid={}, prefetch=16),
    dict(h=4, hk=4, d=64, inter=640, nl=2, s=130, splits=2, grid=dict(blocks=7, warps=5, stages=4), prefetch=-64),
])
def test_decode_chain_matches_the_per_op_chain(name, dt, cfg):
    testing = qgemv._ext.MODULE.testing
    before = testing.chain_attention_form(), testing.chain_attention_prefetch()
    testing.set_chain_attention_form(cfg.get("form", -1))
    testing.set_chain_attention_prefetch(cfg.get("prefetch"))  # None: the rule (persist.h)
    try:
        decode_chain_matches(name, dt, cfg)
    finally:
        testing.set_chain_attention_form(before[0])
        testing.set_chain_attention_prefetch(before[1])


def decode_chain_matches(name, dt, cfg):
    torch.manual_seed(7)
    skip_if_group_cuts(name, cfg["h"] * cfg["d"], cfg["inter"])
    layers, norms, at = decode_setup(name, cfg["h"], cfg["hk"], cfg["d"], cfg["inter"], cfg["nl"], cfg["s"], dt=dt)
    at.splits, at.per_warp = cfg["splits"], cfg.get("per_warp")
    if cfg.get("bias"):
        at.qkv_bias = (torch.randn(cfg["nl"], (cfg["h"] + 2 * cfg["hk"]) * cfg["d"], device="cuda") * 0.5).to(dt)
    if cfg.get("qk_norm"):
        at.q_norm, at.k_norm = ((0.5 + torch.rand(cfg["nl"], cfg["d"], device="cuda")).to(dt) for _ in range(2))
        at.qk_eps = 1e-5
    chain = persist.PersistentChain(layers, norms=norms, eps=1e-5, attention=at, dtype=dt, **cfg["grid"])
    hid = cfg["h"] * cfg["d"]
    for pos in (0, 1, 37, cfg["s"] - 2, cfg["s"] - 1):  # a context of 1 (the token only) up to the whole cache
        x = torch.randn(1, hid, device="cuda").to(dt)
        ref_at = persist.Attention(at.heads, at.kv_heads, at.head_dim, at.cos, at.sin, at.k_cache.clone(),
                                   at.v_cache.clone(), qkv_bias=at.qkv_bias, q_norm=at.q_norm, k_norm=at.k_norm,
                                   qk_eps=at.qk_eps)
        before = at.k_cache.clone(), at.v_cache.clone()
        chain.output.fill_(float("nan"))
        y = chain(x, position=pos)
        ref = persist.reference(layers, x, norms, 1e-5, attention=ref_at, position=pos)
        assert_close_chain(y, ref, x, f"position {pos}")
        for got, want, old, what in ((at.k_cache, ref_at.k_cache, before[0], "k"),
                                     (at.v_cache, ref_at.v_cache, before[1], "v")):
            assert_close_cache(got[:, :, pos], want[:, :, pos], f"{what} cache at {pos}")
            keep = torch.ones(cfg["s"], dtype=torch.bool)
            keep[pos] = False
            assert torch.equal(got[:, :, keep], old[:, :, keep]), f"{what} cache: only slot {pos} may change"


@needs_sm90
def test_decode_chain_replays_in_a_cuda_graph_at_moving_positions():
    torch.manual_seed(8)
    layers, norms, at = decode_setup("int4g128a", 8, 2, 64, 1024, 2, 96)
    chain = persist.PersistentChain(layers, norms=norms, attention=at)
    chain.input.copy_(torch.randn(1, 512, device="cuda").half())
    chain.run()  # warm-up outside the capture (writes slot 0)
    g = torch.cuda.CUDAGraph()
    st = torch.cuda.Stream()
    with torch.cuda.stream(st):
        with torch.cuda.graph(g, stream=st):
            chain.run()
    x = torch.randn(1, 512, device="cuda").half()
    for pos in range(10, 14):  # consecutive decode steps: each feeds its output back
        ref_at = persist.Attention(8, 2, 64, at.cos, at.sin, at.k_cache.clone(), at.v_cache.clone())
        chain.input.copy_(x)
        chain.position.fill_(pos)
        g.replay()
        torch.cuda.synchronize()
        ref = persist.reference(layers, x, norms, 1e-5, attention=ref_at, position=pos)
        assert_close_chain(chain.output, ref, x, f"graph replay at {pos}")
        x = chain.output.clone()


@needs_sm90
def test_both_decode_kernels_match_the_reference_either_side_of_the_octet_rule():
    """octets_at's switch (a unit reaching the rule's 128 positions), and both kernels close to the reference at
    positions either side of it: step_octets False (the kernel without the octet form, the engine's pick below the
    rule, where the form could not run anyway) and True.  Not compared with each other bit for bit: the launch's
    panel sums are not deterministic run to run (persist_chain.cuh).  GQA 4, head_dim 128, one split: a unit is the
    whole context."""
    torch.manual_seed(9)
    s = 300
    layers, norms, at = decode_setup("int4g128a", 8, 2, 128, 1024, 2, s)
    at.splits = 1
    chain = persist.PersistentChain(layers, norms=norms, eps=1e-5, attention=at)
    assert chain.octets and [chain.octets_at(p) for p in (0, 126, 127, s - 1)] == [False, False, True, True]
    for pos in (3, 126, 127, s - 1):
        x = torch.randn(1, 1024, device="cuda").half()
        caches = at.k_cache.clone(), at.v_cache.clone()
        ref_at = persist.Attention(8, 2, 128, at.cos, at.sin, caches[0].clone(), caches[1].clone())
        ref = persist.reference(layers, x, norms, 1e-5, attention=ref_at, position=pos)
        for octets in (False, True):
            at.k_cache.copy_(caches[0]), at.v_cache.copy_(caches[1])
            chain.step_octets = octets
            chain.output.fill_(float("nan"))
            assert_close_chain(chain(x, position=pos), ref, x, f"position {pos}, octet kernel {octets}")


@needs_sm90
def test_step_octets_needs_a_plan_with_the_octet_form():
    torch.manual_seed(10)
    layers, norms, at = decode_setup("int4g128a", 4, 4, 64, 640, 2, 64)  # no GQA: the plan builds no octets
    chain = persist.PersistentChain(layers, norms=norms, eps=1e-5, attention=at)
    assert not chain.octets and not chain.octets_at(63)
    chain.step_octets = True
    with pytest.raises(persist.PersistError, match="step_octets is set, but the plan built no octet attention"):
        chain.run()


def test_octets_at_switches_where_a_unit_can_reach_128_positions():
    """octets_at's arithmetic (no GPU): the first cache slot at which a unit can hold the rule's 128 positions, as
    chain_attention cuts a context of L = slot + 1 into min(splits, ceil(L / (warps x per_warp))) units of at most
    ceil(L / that) positions; the form forced on or off, and a plan without octets."""
    from types import SimpleNamespace

    chain = persist.PersistentChain.__new__(persist.PersistentChain)  # only the fields octets_at reads
    chain.octets, chain._form, chain.warps = True, -1, 16
    for splits, per_warp, first in ((1, None, 127), (16, None, 2032), (33, None, 4191), (16, 64, 127), (16, 4, 2032)):
        chain.splits, chain.attention = splits, SimpleNamespace(per_warp=per_warp)
        assert [chain.octets_at(p) for p in (first - 1, first, first + 1000)] == [False, True, True], \
            (splits, per_warp, first)
    chain._form = 1
    assert chain.octets_at(0)
    chain._form = 0
    assert not chain.octets_at(10**6)
    chain._form, chain.octets = -1, False
    assert not chain.octets_at(10**6)


@needs_ext
def test_head_record_refuses_a_missing_pointer_or_a_k_the_loads_cannot_take():
    """The head's record (what the launch trusts): empty, so refused by the chain, for a missing pointer, K not
    a positive multiple of 8, a copy stride below K or no rows; the device layout's size otherwise."""
    ps = _ext.MODULE.persist
    ok = dict(x=16, ldx=256, gain=32, eps=1e-5, weight=48, V=10, K=256, logits=64, out=0, key=80, count=96, token=112)
    assert ps.head_record(**ok).numel() > 0
    for bad in (dict(x=0), dict(gain=0), dict(weight=0), dict(logits=0), dict(key=0), dict(count=0), dict(token=0),
                dict(K=252, ldx=252), dict(K=0), dict(ldx=128), dict(V=0)):
        assert ps.head_record(**{**ok, **bad}).numel() == 0, bad


def head_reference(chain, head):
    """The per-op end on the launch's own output: logits (float32 [1, V]) of round(weight @ n(output)), n the
    final RMSNorm as the engine rounds it, the sums in fp32."""
    from qgemv.engine import rms_norm

    normed = rms_norm(chain.output, head.gain, head.eps)
    return (normed.float() @ head.weight.float().t()).to(chain.dtype).float()


def assert_head(chain, head, what):
    ref = head_reference(chain, head)
    got = chain.logits
    assert torch.isfinite(got).all(), f"{what}: non-finite logits"
    step = 2.0 ** (math.floor(math.log2(ref.abs().max().item())) - (7 if chain.dtype == BF16 else 10))
    diff = (got - ref).abs().max().item()
    assert diff <= 2 * step, f"{what}: logits off by {diff:.3g} (a step {step:.3g})"
    # the launch's token is the argmax of its own logits, the lowest index on ties, as torch.argmax
    assert chain.token.item() == got.argmax().item(), f"{what}: token {chain.token.item()}"


@needs_sm90
@pytest.mark.parametrize("name,dt", [("int4g128a", torch.float16), ("int8", torch.float16), ("bf16", BF16),
                                     ("int4", BF16), ("fp16", torch.float16)])
@pytest.mark.parametrize("vocab,grid", [(1000, {}), (100, {}), (4099, dict(blocks=7, warps=5, stages=4))])
def test_head_gives_the_per_op_logits_and_their_argmax(name, dt, vocab, grid):
    """The final norm, lm_head and argmax inside the launch (Head): logits within two steps of the activations'
    type of the per-op end on the launch's own output, every step's token their argmax, the output still
    written; a vocabulary smaller than the grid (100 rows over 132 blocks) and odd sizes."""
    torch.manual_seed(9)
    layers, norms, at = decode_setup(name, 4, 2, 64, 640, 2, 48, dt=dt)
    head = persist.Head((torch.randn(vocab, 256, device="cuda") / 16).to(dt), (0.5 + torch.rand(256, device="cuda")).to(dt))
    chain = persist.PersistentChain(layers, norms=norms, eps=1e-5, attention=at, dtype=dt, head=head, **grid)
    for pos in (0, 5, 47):
        x = torch.randn(1, 256, device="cuda").to(dt)
        ref_at = persist.Attention(4, 2, 64, at.cos, at.sin, at.k_cache.clone(), at.v_cache.clone())
        chain.logits.fill_(float("nan"))
        chain.output.fill_(float("nan"))
        y = chain(x, position=pos)
        assert_close_chain(y, persist.reference(layers, x, norms, 1e-5, attention=ref_at, position=pos), x,
                           f"output at {pos}")
        assert_head(chain, head, f"position {pos}")


@needs_sm90
def test_head_argmax_takes_the_lowest_of_tied_rows_and_replays_in_a_graph():
    """Rows 3, 700 and 901 of lm_head equal: their logits tie at the top, and the launch's token is the lowest
    (as torch.argmax), step after step of CUDA graph replays whose outputs feed back."""
    from qgemv.engine import rms_norm

    torch.manual_seed(10)
    layers, norms, at = decode_setup("int4g128a", 4, 2, 64, 640, 2, 32)
    w = (torch.randn(1000, 256, device="cuda") / 64).half()
    head = persist.Head(w, norms[0][0])
    chain = persist.PersistentChain(layers, norms=norms, attention=at, head=head)
    chain.input.copy_(torch.randn(1, 256, device="cuda").half())
    chain.run()
    g = torch.cuda.CUDAGraph()
    st = torch.cuda.Stream()
    with torch.cuda.stream(st):
        with torch.cuda.graph(g, stream=st):
            chain.run()
    for pos in range(4, 8):
        chain.input.copy_(torch.randn(1, 256, device="cuda").half())
        chain.position.fill_(pos)
        chain.run()  # eager: the output this step's tied rows are built from
        u = rms_norm(chain.output, head.gain, head.eps)[0].float()
        tie = (u / u.norm()).half()  # a row along the normed output: larger than every random row's logit
        for r in (901, 3, 700):
            w[r] = tie
        g.replay()
        torch.cuda.synchronize()
        assert_head(chain, head, f"graph replay at {pos}")
        assert chain.token.item() == 3


@needs_sm90
def test_chain_checks_its_head():
    layers, norms, at = decode_setup("int4", 4, 2, 64, 640, 1, 32)
    w, g = torch.zeros(64, 256, device="cuda").half(), torch.ones(256, device="cuda").half()
    with pytest.raises(persist.PersistError, match="head: needs the layers' norms"):
        persist.PersistentChain(layers, head=persist.Head(w, g))
    with pytest.raises(persist.PersistError, match=r"head: weight must be float16 \[vocab, 256\] on cuda:0, got "
                                                   r"torch.float32 \[64, 256\]"):
        persist.PersistentChain(layers, norms=norms, attention=at, head=persist.Head(w.float(), g))
    with pytest.raises(persist.PersistError, match=r"head: weight must be float16 \[vocab, 256\]"):
        persist.PersistentChain(layers, norms=norms, attention=at, head=persist.Head(w[:, :128], g))
    with pytest.raises(persist.PersistError, match=r"head: gain must be float16 \[256\]"):
        persist.PersistentChain(layers, norms=norms, attention=at, head=persist.Head(w, g[:128]))
    with pytest.raises(persist.PersistError, match="head: eps must be positive"):
        persist.PersistentChain(layers, norms=norms, attention=at, head=persist.Head(w, g, eps=0.0))
    with pytest.raises(persist.PersistError, match="head: weight must start 16-byte aligned"):
        persist.PersistentChain(layers, norms=norms, attention=at,
                                head=persist.Head(torch.zeros(64 * 256 + 1, device="cuda").half()[1:].view(64, 256), g))


@needs_sm90
def test_decode_chain_checks_its_attention():
    layers, norms, at = decode_setup("int4", 4, 2, 64, 640, 1, 32)
    with pytest.raises(persist.PersistError, match="attention: needs the layers' norms"):
        persist.PersistentChain(layers, attention=at)
    bad = persist.Attention(4, 2, 64, at.cos, at.sin, at.k_cache.float(), at.v_cache)
    with pytest.raises(persist.PersistError, match=r"attention: k_cache must be contiguous float16 \[1, 2, 32, 64\]"):
        persist.PersistentChain(layers, norms=norms, attention=bad)
    bad = persist.Attention(4, 2, 64, at.cos, at.sin, at.k_cache, at.v_cache,
                            qkv_bias=torch.zeros(1, 256, device="cuda").half())
    with pytest.raises(persist.PersistError, match=r"attention: qkv_bias must be None or contiguous float16 \[1, 512\]"):
        persist.PersistentChain(layers, norms=norms, attention=bad)
    chain = persist.PersistentChain(layers, norms=norms, attention=at)
    with pytest.raises(persist.PersistError, match="position must be in 0..31"):
        chain(torch.zeros(1, 256, device="cuda").half(), position=32)
    with pytest.raises(persist.PersistError, match="position must be in 0..31"):
        chain(torch.zeros(1, 256, device="cuda").half())
