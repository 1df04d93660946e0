"""qgemv.ops.decode_attention: the reference against SDPA with the engine's mask (CPU), its checks, and on a
GPU the CUDA kernel against the reference on fresh random caches whose invisible slots hold NaN."""

import pytest
import torch
from torch.nn import functional as Fn

import qgemv
from qgemv import ops

from conftest import requires_cuda


def caches(B, H, Hkv, S, D, dtype, device, seed, poison=False, slot=None, pad=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, D, generator=g)
    k = torch.randn(B, Hkv, S, D, generator=g)
    v = torch.randn(B, Hkv, S, D, generator=g)
    if poison:  # the slots no query may see: past the step's slot and before each sequence's padding
        keys = torch.arange(S)
        hidden = (keys[None] > slot) | (keys[None] < pad[:, None])
        k[hidden[:, None, :, None].expand_as(k)] = float("nan")
        v[hidden[:, None, :, None].expand_as(v)] = float("nan")
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]


def sdpa_masked(q, k, v, slot, pad, scale):
    """The engine's per-op attention before decode_attention: SDPA over the whole cache with an additive mask."""
    S = k.shape[2]
    keys = torch.arange(S)
    visible = (keys <= slot) & (keys >= pad[:, None])
    mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[:, None, None]
    return Fn.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=q.shape[1] != k.shape[1])[:, :, 0]


@pytest.mark.parametrize("B,H,Hkv,S,D", [(1, 4, 4, 9, 64), (3, 8, 2, 40, 64), (2, 9, 3, 17, 96), (4, 16, 1, 33, 128)])
def test_reference_equals_sdpa_with_the_engines_mask(B, H, Hkv, S, D):
    q, k, v = caches(B, H, Hkv, S, D, torch.float32, "cpu", seed=B * S)
    g = torch.Generator().manual_seed(S)
    slot = int(torch.randint(0, S, (1,), generator=g))
    pad = torch.randint(0, slot + 1, (B,), generator=g)
    got = ops.decode_attention(q, k, v, torch.tensor([slot]), pad, D ** -0.5)
    want = sdpa_masked(q, k, v, slot, pad, D ** -0.5)
    assert got.shape == (B, H, D) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_reference_never_reads_an_invisible_slot():
    B, H, Hkv, S, D = 3, 4, 2, 24, 64
    slot, pad = 15, torch.tensor([0, 4, 15])
    q, k, v = caches(B, H, Hkv, S, D, torch.float32, "cpu", seed=1, poison=True, slot=slot, pad=pad)
    out = ops.decode_attention(q, k, v, torch.tensor([slot]), pad, 0.125)
    assert torch.isfinite(out).all()
    # the last sequence sees its own slot alone: its output is that slot's value row
    torch.testing.assert_close(out[2], v[2, :, slot].repeat_interleave(2, 0))


@pytest.mark.parametrize("change,match", [
    (dict(q=torch.zeros(2, 4, 48), k=torch.zeros(2, 2, 10, 48), v=torch.zeros(2, 2, 10, 48)),
     "head_dim must be 64, 96 or 128"),
    (dict(q=torch.zeros(2, 4, 64, 1)), r"q must be \[batch, heads, head_dim\]"),
    (dict(k=torch.zeros(2, 3, 10, 64), v=torch.zeros(2, 3, 10, 64)), r"heads \(4\) must be kv_heads \(3\)"),
    (dict(q=torch.zeros(2, 17 * 2, 64), k=torch.zeros(2, 2, 10, 64), v=torch.zeros(2, 2, 10, 64)), "times 1..16"),
    (dict(v=torch.zeros(2, 2, 11, 64)), "v_cache must have k_cache's shape"),
    (dict(k=torch.zeros(2, 2, 10, 64, dtype=torch.float16)), "must have q's dtype"),
    (dict(slot=torch.tensor([3], dtype=torch.int32)), "slot must be an int64 tensor"),
    (dict(pad=torch.zeros(3, dtype=torch.long)), r"pad must be int64 \[2\]"),
    (dict(scale=0.0), "scale must be a finite number > 0"),
    (dict(splits=65), "splits must be 0"),
])
def test_bad_arguments_are_named(change, match):
    args = dict(q=torch.zeros(2, 4, 64), k=torch.zeros(2, 2, 10, 64), v=torch.zeros(2, 2, 10, 64),
                slot=torch.tensor([3]), pad=torch.zeros(2, dtype=torch.long), scale=0.125, splits=0)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        ops.decode_attention(args["q"], args["k"], args["v"], args["slot"], args["pad"], args["scale"],
                             args["splits"])


@pytest.mark.skipif(qgemv._ext.MODULE is None, reason="needs the compiled extension (its host-side rule)")
@pytest.mark.parametrize("pairs,slots,max_seq,want", [
    (512, 396, 776, 1),    # Llama-2-7B batch 16 on an H100: the pairs fill the GPU
    (396, 396, 4096, 1),
    (128, 396, 776, 3),    # Llama-3-8B batch 16: 384 blocks, one wave
    (32, 396, 776, 7),     # batch 1, Llama-2-7B: capped at two 64-key tiles of the 776-slot cache a split
    (8, 396, 4096, 32),    # 256 blocks: the cap (two tiles of 4096) before a fuller wave
    (8, 396, 100000, 49),  # 392 of 396 slots
    (1, 396, 100000, 64),  # kDecodeAttnMaxSplits
    (5, 0, 776, 1),        # no device to ask
])
def test_split_rule_fills_whole_waves(pairs, slots, max_seq, want):
    assert qgemv._ext.MODULE.testing.decode_attention_split_rule(pairs, slots, max_seq) == want


@pytest.mark.skipif(qgemv._ext.MODULE is None, reason="needs the compiled extension (its host-side rule)")
@pytest.mark.parametrize("pairs,slots3,want", [
    (512, 264, 3),  # Llama-2-7B batch 16 on an H100 (two 3-stage blocks an SM): the pairs fill the GPU
    (264, 264, 3),
    (128, 264, 4),  # Llama-3-8B batch 16: split over fewer, deeper blocks
    (32, 264, 4),   # batch 1
])
def test_stage_rule_deepens_the_blocks_where_the_pairs_leave_slots_free(pairs, slots3, want):
    assert qgemv._ext.MODULE.testing.decode_attention_stage_rule(pairs, slots3) == want


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_opcheck(device):
    """torch.library.opcheck: the schema, the fake kernel and each device's kernel agree (the CUDA kernel
    where the extension is built; else the reference the loader registers for CUDA)."""
    dtype = torch.float32 if device == "cpu" else torch.float16
    q, k, v = caches(2, 8, 2, 40, 64, dtype, device, seed=3)
    slot, pad = torch.tensor([30], device=device), torch.tensor([0, 7], device=device)
    for splits in (0, 2):
        torch.library.opcheck(torch.ops.qgemv.decode_attention.default, (q, k, v, slot, pad, 0.125, splits))


def _cuda_kernel_available():
    return (torch.cuda.is_available() and qgemv._ext.BACKEND in ("aot", "jit")
            and torch.cuda.get_device_capability() >= (8, 0))


needs_kernel = pytest.mark.skipif(not _cuda_kernel_available(), reason="needs the compiled extension on sm_80+")

# (B, H, Hkv, S, D): GQA 1 / 4 / 3 / 7 / 8 / 16, head sizes 64 / 96 / 128, caches shorter and longer than a tile
CONFIGS = [(1, 8, 8, 70, 64), (3, 32, 8, 300, 128), (2, 9, 3, 129, 64), (5, 28, 4, 64, 128), (16, 32, 4, 200, 128),
           (4, 16, 1, 1000, 96), (2, 14, 2, 777, 64), (7, 40, 8, 5, 128)]


@requires_cuda
@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits", [0, 1, 3, 64])
@pytest.mark.parametrize("cfg", CONFIGS, ids=[f"B{c[0]}H{c[1]}kv{c[2]}S{c[3]}D{c[4]}" for c in CONFIGS])
def test_cuda_kernel_matches_the_reference(cfg, splits, dtype):
    B, H, Hkv, S, D = cfg
    g = torch.Generator().manual_seed(sum(cfg) + splits)
    for trial in range(3):
        slot = [0, S - 1, int(torch.randint(0, S, (1,), generator=g))][trial]
        pad = torch.randint(0, slot + 1, (B,), generator=g)
        pad[0] = 0
        q, k, v = caches(B, H, Hkv, S, D, dtype, "cuda", seed=trial + 7 * S, poison=True, slot=slot, pad=pad)
        slot_t, pad_t = torch.tensor([slot], device="cuda"), pad.cuda()
        got = ops.decode_attention(q, k, v, slot_t, pad_t, D ** -0.5, splits)
        want = ops.ref_decode_attention(q.cpu(), k.cpu(), v.cpu(), slot_t.cpu(), pad, D ** -0.5).float()
        assert got.shape == (B, H, D) and got.dtype == dtype
        # The kernel rounds the probabilities to the dtype before they meet V (2^-11 relative in fp16, 2^-8 in
        # bf16), then the output (|out| <= max |v|, about 4 for these normal draws): at most ~4 x 2^-11 +
        # 2^-11 = 2.4e-3 in fp16 and 2e-2 in bf16 against the fp32 reference, with some margin for the sums
        tol = 4e-3 if dtype == torch.float16 else 3e-2
        err = (got.float().cpu() - want).abs().max().item()
        assert err < tol, f"slot {slot}, pad {pad.tolist()}: max error {err:.2e}"


@requires_cuda
@needs_kernel
@pytest.mark.parametrize("cfg", [(16, 32, 32, 700, 128), (3, 32, 8, 300, 128), (2, 14, 2, 777, 64),
                                 (4, 16, 1, 1000, 96)])
def test_cuda_kernel_gives_the_same_bits_with_every_stage_count(cfg):
    """testing.set_decode_attention_stages (2, 3 or 4 K / V tiles a block) changes how many copies fly, not
    which keys a warp sums in what order: every count's output equals the default's bit for bit, at forced
    splits and at the chosen count (which follows the blocks an SM holds), and matches the reference."""
    B, H, Hkv, S, D = cfg
    t = qgemv._ext.MODULE.testing
    slot = S - 3
    pad = torch.randint(0, slot + 1, (B,), generator=torch.Generator().manual_seed(S))
    pad[0] = 0
    q, k, v = caches(B, H, Hkv, S, D, torch.float16, "cuda", seed=S, poison=True, slot=slot, pad=pad)
    slot_t, pad_t = torch.tensor([slot], device="cuda"), pad.cuda()
    want = ops.ref_decode_attention(q.cpu(), k.cpu(), v.cpu(), slot_t.cpu(), pad, D ** -0.5).float()
    with pytest.raises(ValueError, match=r"stages must be 0 \(the rule\), 2, 3 or 4, got 5"):
        t.set_decode_attention_stages(5)
    assert t.decode_attention_stages() == 0  # (the default: the rule)
    try:
        for splits in (1, 3):
            outs = {}
            for stages in (2, 3, 4):
                t.set_decode_attention_stages(stages)
                outs[stages] = ops.decode_attention(q, k, v, slot_t, pad_t, D ** -0.5, splits)
            for stages in (3, 4):
                assert torch.equal(outs[stages], outs[2]), f"splits {splits}, stages {stages}"
            assert (outs[2].float().cpu() - want).abs().max().item() < 4e-3
        for stages in (0, 4):  # the rule's count, then a forced one, at the split count each chooses
            t.set_decode_attention_stages(stages)
            chosen = ops.decode_attention(q, k, v, slot_t, pad_t, D ** -0.5)
            assert torch.isfinite(chosen).all() and (chosen.float().cpu() - want).abs().max().item() < 4e-3
    finally:
        t.set_decode_attention_stages(0)


@requires_cuda
@needs_kernel
def test_cuda_kernel_reads_q_through_its_strides_and_follows_the_slot_in_a_graph():
    B, H, Hkv, S, D = 3, 16, 4, 256, 128
    wide, k, v = torch.randn(B, H, 3 * D, device="cuda", dtype=torch.float16), *[
        torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.float16) for _ in range(2)]
    q = wide[:, :, D:2 * D]  # [B, H, D] rows 3 D apart
    assert not q.is_contiguous()
    slot, pad = torch.tensor([0], device="cuda"), torch.tensor([0, 0, 0], device="cuda")
    out = ops.decode_attention(q, k, v, slot, pad, D ** -0.5, checked=True)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.decode_attention(q, k, v, slot, pad, D ** -0.5, checked=True)
    for s, p in ((5, [0, 2, 5]), (100, [0, 60, 99]), (255, [3, 0, 200])):
        slot.fill_(s)
        pad.copy_(torch.tensor(p))
        graph.replay()
        want = ops.ref_decode_attention(q.cpu(), k.cpu(), v.cpu(), slot.cpu(), pad.cpu(), D ** -0.5).float()
        assert (out.float().cpu() - want).abs().max().item() < 4e-3, f"slot {s}"


@requires_cuda
@needs_kernel
def test_cuda_wrapper_refuses_what_the_kernel_cannot_read():
    q = torch.zeros(2, 4, 64, device="cuda", dtype=torch.float16)
    k = torch.zeros(2, 2, 10, 64, device="cuda", dtype=torch.float16)
    slot, pad = torch.tensor([3], device="cuda"), torch.zeros(2, dtype=torch.long, device="cuda")
    with pytest.raises(ValueError, match="k_cache must have contiguous rows"):  # (the kernel's own checks:
        ops.decode_attention(q, k.transpose(2, 3).contiguous().transpose(2, 3), k, slot, pad, 0.1)  # bad_input_cuda)
    with pytest.raises(ValueError, match="must be on the same device as q"):
        ops.decode_attention(q, k, k, slot.cpu(), pad, 0.125)
    # rope_decode_attention reads 8 dims at a time in 16-byte loads
    qr, kr, vr, cos, sin, _, _ = rope_inputs(2, 4, 2, 10, 64, torch.float16, "cuda", seed=2)
    odd = torch.zeros(2 * 4 * 64 + 1, device="cuda", dtype=torch.float16)[1:].view(2, 4, 64)
    with pytest.raises(ValueError, match="q must start on a 16-byte boundary"):
        ops.rope_decode_attention(odd, kr, vr, k, k.clone(), slot, pad, cos, sin, None, None, 1e-6, 0.125)
    with pytest.raises(ValueError, match="cos must be contiguous and start on a 16-byte boundary"):
        ops.rope_decode_attention(qr, kr, vr, k, k.clone(), slot, pad, cos.t().contiguous().t(), sin, None, None,
                                  1e-6, 0.125)


# ---- rope_decode_attention: the token's norms, rotation and cache write, then decode attention, one kernel
def rope_inputs(B, H, Hkv, S, D, dtype, device, seed, norms=False):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(B, (H + 2 * Hkv) * D, generator=g)  # the fused q/k/v projection's output
    pos = torch.arange(S)[:, None] / 10000 ** (torch.arange(D // 2) / (D // 2))
    cos = torch.cat((pos.cos(), pos.cos()), -1)
    sin = torch.cat((pos.sin(), pos.sin()), -1)
    qn = 1 + 0.1 * torch.randn(D, generator=g) if norms else None
    kn = 1 + 0.1 * torch.randn(D, generator=g) if norms else None
    to = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    wide = to(wide)
    q = wide[:, :H * D].view(B, H, D)
    k = wide[:, H * D:(H + Hkv) * D].view(B, Hkv, D)
    v = wide[:, (H + Hkv) * D:].view(B, Hkv, D)
    return q, k, v, to(cos), to(sin), to(qn), to(kn)


@pytest.mark.parametrize("norms", [False, True])
def test_rope_reference_is_the_engines_glue_then_decode_attention(norms):
    """In float32 on the CPU the op's reference is exactly what the engine's per-op step computed in two
    calls: glue_attention_in (q / k norms, RoPE, the cache write) and decode_attention."""
    from qgemv.engine import glue_attention_in
    B, H, Hkv, S, D = 3, 8, 2, 24, 64
    q, k, v, cos, sin, qn, kn = rope_inputs(B, H, Hkv, S, D, torch.float32, "cpu", seed=5, norms=norms)
    kc, vc = (torch.randn(B, Hkv, S, D, generator=torch.Generator().manual_seed(i)) for i in (1, 2))
    slot, pad = torch.tensor([17]), torch.tensor([0, 4, 17])
    kc2, vc2 = kc.clone(), vc.clone()
    got = ops.rope_decode_attention(q, k, v, kc, vc, slot, pad, cos, sin, qn, kn, 1e-6, D ** -0.5)
    pos = (slot - pad).clamp(min=0)
    qr = glue_attention_in(q[:, None], k[:, None], v[:, None], cos[pos][:, None, None], sin[pos][:, None, None],
                           kc2, vc2, slot, qn, kn, 1e-6)
    want = ops.decode_attention(qr[:, :, 0], kc2, vc2, slot, pad, D ** -0.5)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert torch.equal(got, want)


def test_rope_bad_arguments_are_named():
    B, H, Hkv, S, D = 2, 4, 2, 10, 64
    q, k, v, cos, sin, _, _ = rope_inputs(B, H, Hkv, S, D, torch.float32, "cpu", seed=1)
    kc, vc = torch.zeros(B, Hkv, S, D), torch.zeros(B, Hkv, S, D)
    base = dict(q=q, k=k, v=v, k_cache=kc, v_cache=vc, slot=torch.tensor([3]), pad=torch.zeros(B, dtype=torch.long),
                cos=cos, sin=sin, q_norm=None, k_norm=None, eps=1e-6, scale=0.125)
    for change, match in [
        (dict(k=torch.zeros(B, Hkv + 1, D)), r"k must be \[2, 2, 64\]"),
        (dict(v=torch.zeros(B, Hkv, D, dtype=torch.float16)), "v must have q's dtype"),
        (dict(cos=cos[:S - 1]), r"cos must be \[>= 10, 64\]"),
        (dict(q_norm=torch.ones(D)), "q_norm and k_norm must be given together"),
        (dict(q_norm=torch.ones(D + 1), k_norm=torch.ones(D)), r"q_norm must be a contiguous \[64\]"),
        (dict(eps=-1.0), "eps must be a finite number >= 0"),
        (dict(k_cache=torch.zeros(B, Hkv, S, 32)), r"k_cache must be \[2, kv_heads, max_seq, 64\]"),
    ]:
        args = dict(base, **change)
        with pytest.raises(ValueError, match="rope_decode_attention: " + match):
            ops.rope_decode_attention(**args)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_rope_opcheck(device):
    """torch.library.opcheck on the mutating op: its schema's (a!) / (b!) caches, the fake and the kernel."""
    dtype = torch.float32 if device == "cpu" else torch.float16
    B, H, Hkv, S, D = 2, 8, 2, 40, 64
    q, k, v, cos, sin, qn, kn = rope_inputs(B, H, Hkv, S, D, dtype, device, seed=3, norms=True)
    kc, vc = (torch.randn(B, Hkv, S, D, device=device, dtype=dtype) for _ in range(2))
    slot, pad = torch.tensor([30], device=device), torch.tensor([0, 7], device=device)
    for splits in (0, 2):
        torch.library.opcheck(torch.ops.qgemv.rope_decode_attention.default,
                              (q, k, v, kc, vc, slot, pad, cos, sin, qn, kn, 1e-6, 0.125, splits))


@requires_cuda
@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits", [0, 1, 3])
@pytest.mark.parametrize("norms", [False, True])
@pytest.mark.parametrize("cfg", CONFIGS, ids=[f"B{c[0]}H{c[1]}kv{c[2]}S{c[3]}D{c[4]}" for c in CONFIGS])
def test_rope_cuda_kernel_matches_the_reference(cfg, norms, splits, dtype):
    """The fused kernel against the reference on fresh random inputs: the output, and the caches' rows at the
    slot (the rotated key, the value) with every other row untouched; invisible slots hold NaN."""
    B, H, Hkv, S, D = cfg
    g = torch.Generator().manual_seed(sum(cfg) + splits + norms)
    for trial in range(3):
        slot = [0, S - 1, int(torch.randint(0, S, (1,), generator=g))][trial]
        pad = torch.randint(0, slot + 1, (B,), generator=g)
        pad[0] = 0
        _, kc, vc = caches(B, H, Hkv, S, D, dtype, "cuda", seed=trial + 7 * S, poison=True, slot=slot, pad=pad)
        q, k, v, cos, sin, qn, kn = rope_inputs(B, H, Hkv, S, D, dtype, "cuda", seed=trial + S, norms=norms)
        slot_t, pad_t = torch.tensor([slot], device="cuda"), pad.cuda()
        kc_ref, vc_ref = kc.cpu().clone(), vc.cpu().clone()
        got = ops.rope_decode_attention(q, k, v, kc, vc, slot_t, pad_t, cos, sin, qn, kn, 1e-6, D ** -0.5, splits)
        want = ops.ref_rope_decode_attention(
            q.cpu(), k.cpu(), v.cpu(), kc_ref, vc_ref, slot_t.cpu(), pad, cos.cpu(), sin.cpu(),
            None if qn is None else qn.cpu(), None if kn is None else kn.cpu(), 1e-6, D ** -0.5).float()
        assert got.shape == (B, H, D) and got.dtype == dtype
        tol = 4e-3 if dtype == torch.float16 else 3e-2  # (test_cuda_kernel_matches_the_reference's bound)
        err = (got.float().cpu() - want).abs().max().item()
        assert err < tol, f"slot {slot}, pad {pad.tolist()}: max error {err:.2e}"
        # the caches: the value row as it was given, the key row within one rounding of the reference's, the
        # rest (NaN-poisoned rows included) untouched
        assert torch.equal(vc.cpu()[:, :, slot], vc_ref[:, :, slot])
        step = 2 ** -10 if dtype == torch.float16 else 2 ** -7
        kdiff = (kc.cpu()[:, :, slot].float() - kc_ref[:, :, slot].float()).abs()
        # (a few roundings apart: with the norms, rsqrtf against torch's rsqrt can move the normalized value, its
        # product with the gain and the rotation each by one step)
        assert (kdiff <= 4 * step * kc_ref[:, :, slot].float().abs().clamp(min=1)).all(), kdiff.max()
        rest = torch.ones(S, dtype=torch.bool)
        rest[slot] = False
        assert torch.equal(kc.cpu()[:, :, rest].isnan(), kc_ref[:, :, rest].isnan())
        assert torch.equal(torch.nan_to_num(kc.cpu()[:, :, rest]), torch.nan_to_num(kc_ref[:, :, rest]))


@requires_cuda
@needs_kernel
def test_rope_cuda_kernel_equals_its_two_kernel_form_with_each_stage_count():
    """Without q / k norms the fused kernel's output equals, bit for bit and at every stage count,
    decode_attention's on the query rotated by torch on the GPU (x cos + rotate_half(x) sin: two rounded fp32
    products, their rounded sum, rounded to fp16, as the kernel computes it) and on the caches the fused kernel
    wrote: the fusion changes where q, k and v come from, not the sums."""
    B, H, Hkv, S, D = 16, 32, 8, 300, 128
    t = qgemv._ext.MODULE.testing
    q, k, v, cos, sin, _, _ = rope_inputs(B, H, Hkv, S, D, torch.float16, "cuda", seed=11)
    slot, pad = torch.tensor([250], device="cuda"), torch.randint(0, 200, (B,)).cuda()
    pos = (slot - pad).clamp(min=0)
    c, sn, f = cos[pos].float()[:, None], sin[pos].float()[:, None], q.float()
    q_rot = (f * c + torch.cat((-f[..., D // 2:], f[..., :D // 2]), -1) * sn).half()
    try:
        for stages in (2, 3, 4):
            t.set_decode_attention_stages(stages)
            _, kc, vc = caches(B, H, Hkv, S, D, torch.float16, "cuda", seed=stages)
            for splits in (1, 3):
                got = ops.rope_decode_attention(q, k, v, kc, vc, slot, pad, cos, sin, None, None, 1e-6,
                                                D ** -0.5, splits)
                two = ops.decode_attention(q_rot, kc, vc, slot, pad, D ** -0.5, splits)
                assert torch.equal(got, two), f"stages {stages}, splits {splits}"
    finally:
        t.set_decode_attention_stages(0)


def _pdl_steps(qkv_src, kc, vc, slot, pad, cos, sin, steps, D):
    """Steps of rope_decode_attention whose inputs the kernels just before it write: the fused q / k / v
    (an elementwise kernel from the last output), then the slot (slot + 1); each step's cache write is read by
    the next. Returns every step's output."""
    B, H = qkv_src.shape[0], qkv_src.shape[1] // D - 2 * kc.shape[1]
    Hkv = kc.shape[1]
    wide = torch.empty_like(qkv_src)
    outs, last = [], torch.zeros(B, H * D, device=qkv_src.device, dtype=qkv_src.dtype)
    for _ in range(steps):
        torch.add(qkv_src, torch.cat((last, last[:, :2 * Hkv * D]), 1), alpha=0.25, out=wide)
        slot.add_(1)
        q = wide[:, :H * D].view(B, H, D)
        k = wide[:, H * D:(H + Hkv) * D].view(B, Hkv, D)
        v = wide[:, (H + Hkv) * D:].view(B, Hkv, D)
        out = ops.rope_decode_attention(q, k, v, kc, vc, slot, pad, cos, sin, None, None, 1e-6, D ** -0.5)
        outs.append(out)
        last = out.reshape(B, H * D)
    return outs


@requires_cuda
@needs_kernel
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_rope_cuda_kernel_as_a_programmatic_launch_reads_what_the_kernels_before_wrote(graph):
    """Under qgemv.set_gemv_pdl(7) decode_attention is a programmatic launch too: it may start (and prefetch
    its first K / V rows into L2) while the kernel before it runs, which here writes its q / k / v and its slot.
    Five chained steps equal the ordinary launches' bit for bit, outputs and caches, eager and in a graph."""
    B, H, Hkv, S, D = 16, 32, 8, 300, 128
    C = qgemv._ext.MODULE
    q, k, v, cos, sin, _, _ = rope_inputs(B, H, Hkv, S, D, torch.float16, "cuda", seed=5)
    src = torch.cat((q.reshape(B, -1), k.reshape(B, -1), v.reshape(B, -1)), 1)
    pad = torch.randint(0, 100, (B,), generator=torch.Generator().manual_seed(5)).cuda()
    _, kc0, vc0 = caches(B, H, Hkv, S, D, torch.float16, "cuda", seed=6)
    results = {}
    for mode in (0, 7):
        C.set_gemv_pdl(mode)
        try:
            if mode and not C.gemv_pdl_flags():
                pytest.skip("programmatic dependent launch needs compute capability 9.0 and an sm_90 build")
            kc, vc, slot = kc0.clone(), vc0.clone(), torch.tensor([200], device="cuda")
            if not graph:
                outs = _pdl_steps(src, kc, vc, slot, pad, cos, sin, 5, D)
            else:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # warm-up outside the capture
                    _pdl_steps(src, kc.clone(), vc.clone(), slot.clone(), pad, cos, sin, 1, D)
                torch.cuda.current_stream().wait_stream(stream)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    outs = _pdl_steps(src, kc, vc, slot, pad, cos, sin, 5, D)
                kc.copy_(kc0), vc.copy_(vc0), slot.fill_(200)
                for o in outs:
                    o.fill_(float("nan"))
                g.replay()
            torch.cuda.synchronize()
            results[mode] = ([o.clone() for o in outs], kc, vc)
        finally:
            C.set_gemv_pdl(-1)
    (o0, k0, v0), (o7, k7, v7) = results[0], results[7]
    for i, (a, b) in enumerate(zip(o0, o7)):
        assert torch.isfinite(a).all() and torch.equal(a, b), f"step {i}: the programmatic launch changed it"
    assert torch.equal(k0, k7) and torch.equal(v0, v7)
